"""The quantized linear with its rows' LoRA updates in one call
(kernels/cpu/csrc/quant_linear.h, lora.h's Folded), on every compiled build:

* the same numbers, bit for bit, as quant_linear, lora_shrink and lora_expand
  called in turn on that build (themselves held to the references by
  test_quant_linear.py and test_lora_kernels.py): 1, 3, 16 and the build's
  last folded token count, where shrink and expand run inside the linear's
  region, and beyond it, where they run after it; one and several parts,
  slices (SmolLM2's q | k | v), ranks 4 and 16, a bias, bf16 and float32
  rows, ids with -1 among them, one, two and three threads;
* rows without an adapter are the plain linear's rows;
* what cannot be folded is refused: float_out, a missing B, B of other outputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernel_cases import case_seed
from kernels.quant import pack_quant_panels, pack_quant_weight
from lora_cases import SLOTS, make_ids

# Tokens fold below the count from which a call takes strips (quant_linear.h's
# takes_strips): float32 tokens on AVX512-BF16 below kManyRows (32); bf16
# tokens there, every token on the avx512 build (kVnniManyRows) and on AVX2
# (kMaddubsManyRows) below 8, past which they take the int8 strips; 8 portable.
LAST_FOLDED = {"avx512bf16": 31, "avx512": 7, "avx2": 7, "portable": 7}
LAST_FOLDED_BF16 = {"avx512bf16": 7}


def _blob(generator, types, out_features, in_features):
    """A blob of one part per type, each `out_features` rows of random weights
    rounded to it as llama.cpp's quantizer rounds them."""
    from gguf import GGMLQuantizationType, quants

    from kernels.quantize_k import quantize_q4_k

    parts = []
    for name in types:
        values = torch.randn(out_features, in_features, generator=generator).numpy()
        data = quantize_q4_k(values) if name == "Q4_K" else quants.quantize(
            values, GGMLQuantizationType[name])
        parts.append((name, torch.from_numpy(np.ascontiguousarray(data))))
    return pack_quant_weight(parts, in_features)


def _case(session_seed, tokens, types, rank, slices, dtype):
    g = torch.Generator().manual_seed(case_seed(session_seed, repr((tokens, types, rank, slices, dtype))))
    width, out = 256, 192 * len(types)
    blocks = 1 if slices is None else len(slices) - 1
    x = torch.randn(tokens, width, generator=g).to(dtype)
    a = (torch.randn(SLOTS, blocks * rank, width, generator=g) / width ** 0.5).to(dtype)
    b = (torch.randn(SLOTS, out, rank, generator=g) / rank ** 0.5).to(dtype)
    bias = torch.randn(out, generator=g)
    ids = make_ids(tokens, SLOTS, g)
    ids[-1] = 1  # at least one row under an adapter
    return x, _blob(g, types, out // len(types), width), bias, a, b, ids


def _in_turn(ops, x, blob, bias, ids, a, b, slices):
    y = ops.quant_linear(x, blob, bias, False)
    return ops.lora_expand(y, ops.lora_shrink(x, a, ids, 1.0), b, ids, slices)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("shape", [(("Q4_1",), 16, None), (("Q8_0", "Q4_K", "Q4_0"), 4, (0, 192, 384, 576)),
                                   (("Q4_1", "Q4_1"), 16, (0, 192, 384))],
                         ids=["one-part", "qkv-slices", "gate-up"])
def test_folded_rows_are_the_three_ops_in_turn(builds, shape, dtype, session_seed):
    types, rank, slices = shape
    threads = torch.get_num_threads()
    try:
        for isa, ops in builds.items():
            last = (LAST_FOLDED_BF16 if dtype == torch.bfloat16 else {}).get(isa, LAST_FOLDED[isa])
            for tokens in sorted({1, 3, 16, last, last + 5}):
                x, blob, bias, a, b, ids = _case(session_seed, tokens, types, rank, slices, dtype)
                expected = _in_turn(ops, x, blob, bias, ids, a, b, slices)
                for count in (1, 2, 3):
                    torch.set_num_threads(count)
                    got = ops.quant_linear(x, blob, bias, False, ids, a, b, slices)
                    assert torch.equal(got, expected), (isa, tokens, count)
                plain = ops.quant_linear(x, blob, bias, False)
                assert torch.equal(got[ids < 0], plain[ids < 0]), (isa, tokens)
                assert not torch.equal(got[ids >= 0], plain[ids >= 0]), (isa, tokens)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_adapters_over_panels_are_the_three_ops_in_turn(builds, tokens, session_seed):
    """A blob in 16-row panels (kernels/quant.py) is not folded: the linear,
    then the adapters' two ops, the same numbers."""
    ops = builds.get("avx512bf16") or builds.get("avx512")
    if ops is None:
        pytest.skip("panels are multiplied by the AVX512-VNNI build; this CPU does not run it")
    slices = (0, 192, 384)
    x, blob, bias, a, b, ids = _case(session_seed, tokens, ("Q4_K", "Q4_K"), 16, slices, torch.bfloat16)
    paneled = pack_quant_panels(blob)
    got = ops.quant_linear(x, paneled, bias, False, ids, a, b, slices)
    assert torch.equal(got, _in_turn(ops, x, paneled, bias, ids, a, b, slices))
    assert not torch.equal(got[ids >= 0], ops.quant_linear(x, paneled, bias, False)[ids >= 0])


def test_what_cannot_be_folded_is_refused(compiled_cpu_ops, session_seed):
    ops = compiled_cpu_ops
    x, blob, bias, a, b, ids = _case(session_seed, 2, ("Q4_1",), 4, None, torch.bfloat16)
    with pytest.raises(ValueError, match="float_out"):
        ops.quant_linear(x, blob, bias, True, ids, a, b)
    with pytest.raises(ValueError, match="needs lora_a and lora_b"):
        ops.quant_linear(x, blob, bias, False, ids, a, None)
    with pytest.raises(ValueError, match="outputs, the weight"):
        ops.quant_linear(x, blob, bias, False, ids, a, b[:, :100].contiguous())
    with pytest.raises(RuntimeError, match="rows' dtype"):
        ops.quant_linear(x, blob, bias, False, ids, a.float(), b)
