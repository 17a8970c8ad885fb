"""The de-quantized strips of every build: the file's values rounded to bf16.

Past a few tokens a quantized linear either meets int8 tokens in integer
strips (the VNNI and AVX2 builds) or de-quantizes a strip of weight rows to
bf16 and runs the packed tiles over it (quant_strips.h's run_dequantized:
the portable build, float32 tokens on the AVX512-BF16 build, and any build
under PAGEDSERVE_QUANT_STRIPS=bf16, the switch for side-by-side runs).
Every build rounds the weights in its own instructions (cvtne2ps on
AVX512-BF16, integer arithmetic on the avx512 and AVX2 builds, one float at
a time on the portable one), so this checks them against torch's own
rounding: each product is x times the reference's de-quantized weights
rounded to bf16, to float32's summation error. The 8-bit activation bound
of test_quant_linear.py is ~100x looser and would not see a weight off by
one part in a thousand.

The switch is read once per process, so each build runs in a child process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from kernels.cpu import ops as cpu_ops
from kernels.quant import QUANT_TYPES, dequantize_reference, pack_quant_weight, random_quant_blocks

ROWS = 96  # tokens: past every build's many-token threshold (kManyRows, 32 at most)

_CHILD = """
import sys, torch
from kernels.cpu import ops as cpu_ops
cases = torch.load(sys.argv[1])
ops = cpu_ops.current_ops()
torch.save({name: ops.quant_linear(x, blob, None, True) for name, (x, blob) in cases.items()}, sys.argv[2])
"""


def _cases(generator) -> dict:
    """{type name: (x, blob)} with rows of 3 blocks (2 K-quant super-blocks)."""
    cases = {}
    for name, kind in QUANT_TYPES.items():
        in_features = (3 if kind.block_elems == 32 else 2) * kind.block_elems
        data = random_quant_blocks(name, 40, in_features, generator)
        data[:2] = 0  # all-zero blocks: every field 0
        x = torch.randn(ROWS, in_features, generator=generator)
        cases[name] = (x, pack_quant_weight([(name, data)], in_features))
    return cases


def _run_build(isa: str, cases: dict, tmp_path: Path) -> dict:
    inputs, outputs = tmp_path / f"{isa}-in.pt", tmp_path / f"{isa}-out.pt"
    torch.save(cases, inputs)
    env = {**os.environ, "PAGEDSERVE_QUANT_STRIPS": "bf16", cpu_ops.ENV_VAR: isa}
    subprocess.run([sys.executable, "-c", _CHILD, str(inputs), str(outputs)], env=env, check=True,
                   timeout=600, cwd=Path(__file__).resolve().parents[2])
    return torch.load(outputs)


def test_dequantized_strips_are_the_file_values_rounded_to_bf16(builds, tmp_path, session_seed):
    generator = torch.Generator().manual_seed(session_seed)
    cases = _cases(generator)
    for isa in builds:
        got = _run_build(isa, cases, tmp_path)
        for name, (x, blob) in cases.items():
            weight = dequantize_reference(blob).bfloat16().double()
            expected = x.double() @ weight.t()
            magnitude = x.double().abs() @ weight.abs().t()
            error = (got[name].double() - expected).abs()
            worst = (error / (magnitude * 1e-5 + 1e-30)).max().item()
            assert worst <= 1, f"{isa} {name} seed {session_seed}: {worst:.2f}x float32's summation bound"
