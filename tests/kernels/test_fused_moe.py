"""fused_moe (the experts of a mixture-of-experts layer) on every path:
the grouped reference against a per-token loop, the CPU path (kernels.linear,
the compiled bf16 linear, packed per-expert weights) against the reference,
and the Triton kernels under the interpreter (a child process, float32:
the interpreter's bf16 arithmetic is broken) against the reference.

Edge cases: T = 0 and 1, k = 1, 2 and E, experts no token picks, widths
that no block divides, token counts spanning several blocks per expert.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.moe import fused_moe_cpu, pack_experts
from kernels.reference import fused_moe_reference
from kernel_subprocess import child_env, run_cases_script
from moe_cases import RESULT_PREFIX, make_inputs
from need import need

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _case(case_id, T, H=64, I=32, E=8, k=2, **extra):  # noqa: E741 - the contract's names
    return {"id": case_id, "T": T, "H": H, "I": I, "E": E, "k": k, "seed": len(case_id), **extra}


CASES = [
    _case("t1-k1", 1, k=1),
    _case("t1-k2", 1),
    _case("t5-k2-unused-experts", 5, unused=[3, 6]),
    _case("t40-k2", 40),
    _case("t9-k8-every-expert", 9, k=8),
    _case("t7-odd-widths-e4", 7, H=48, I=40, E=4),
    _case("t0", 0),
]
TRITON_CASES = CASES + [
    _case("small-blocks", 6, H=80, I=48, config={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32}),
    _case("t140-block-m-64", 140, H=32, I=16),
]
ids = [case["id"] for case in CASES]


def per_token_loop(x, w_gate_up, w_down, topk_weights, topk_ids):
    """The contract spelled out: one token, one chosen expert at a time."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate, up = (w_gate_up[e] @ x[t]).chunk(2)
            out[t] += topk_weights[t, j] * (w_down[e] @ (F.silu(gate) * up))
    return out.to(x.dtype)


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_reference_matches_per_token_loop(case):
    inputs = make_inputs(case)
    torch.testing.assert_close(fused_moe_reference(*inputs), per_token_loop(*inputs))


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_cpu_path_float32_is_the_reference(case):
    """float32 takes torch's linear and activation: the same arithmetic, bit for bit."""
    inputs = make_inputs(case)
    assert torch.equal(fused_moe_cpu(*inputs), fused_moe_reference(*inputs))
    assert torch.equal(kernels.fused_moe(*inputs), fused_moe_reference(*inputs))


def _bf16_close(out, expected):
    # fp32 sums over bf16 inputs, rounded to bf16 a few times (the reference rounds
    # each expert's output, the CPU path only the sum): a few bf16 ulps of O(1) values.
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_cpu_path_bf16_matches_reference(case, compiled_cpu_ops):
    inputs = make_inputs(case, torch.bfloat16)
    if case["H"] == 64:  # a width every build's vectors divide: the compiled linear runs
        assert kernels.compiled_bf16_linear(case["H"]) and kernels.compiled_bf16_linear(case["I"])
    out = fused_moe_cpu(*inputs)
    assert out.dtype == torch.bfloat16 and out.shape == inputs[0].shape
    _bf16_close(out, fused_moe_reference(*inputs))
    _bf16_close(out, fused_moe_reference(*[t.float() for t in inputs[:3]], *inputs[3:]))


@pytest.mark.parametrize("case", CASES[:5], ids=ids[:5])
def test_cpu_path_reads_packed_expert_weights(case, compiled_cpu_ops):
    x, w_gate_up, w_down, weights, topk_ids = make_inputs(case, torch.bfloat16)
    packed_gate_up, packed_down = pack_experts(w_gate_up), pack_experts(w_down)
    if not hasattr(compiled_cpu_ops, "linear_bf16_packed"):
        assert packed_gate_up is w_gate_up and packed_down is w_down  # nothing to pack
    else:
        assert packed_gate_up.dim() == packed_down.dim() == 5
        for e in range(w_gate_up.shape[0]):
            assert torch.equal(kernels.unpack_linear(packed_gate_up[e]), w_gate_up[e])
        assert pack_experts(packed_gate_up) is packed_gate_up  # packing twice changes nothing
    out = fused_moe_cpu(x, packed_gate_up, packed_down, weights, topk_ids)
    _bf16_close(out, fused_moe_reference(x, w_gate_up, w_down, weights, topk_ids))
    torch.testing.assert_close(out, fused_moe_cpu(x, w_gate_up, w_down, weights, topk_ids),
                               atol=1e-2, rtol=1e-2)


def test_backends_name_their_fused_moe():
    assert kernels.get_backend("torch").fused_moe is fused_moe_reference
    assert kernels.get_backend("cpu").fused_moe is fused_moe_cpu
    assert kernels.get_backend("auto").fused_moe is kernels.fused_moe


def test_moe_align_blocks_hold_one_expert_each(triton_available):
    proc = subprocess.run(
        [sys.executable, "-c", ALIGN_PROBE], cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(child_env(), TRITON_INTERPRET="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"


# Run in a child: importing triton here would fix the interpreter choice for the whole session.
ALIGN_PROBE = """
import torch
from kernels.fused_moe_triton import moe_align
ids = torch.tensor([[0, 2], [2, 5], [5, 0], [5, 2]])
pairs, experts = moe_align(ids, 8, 4)
flat = ids.reshape(-1)
assert pairs.numel() == experts.numel() * 4
real = pairs[pairs < flat.numel()]
assert sorted(real.tolist()) == list(range(flat.numel()))          # each pair once
for block, expert in enumerate(experts.tolist()):
    rows = pairs[block * 4:(block + 1) * 4]
    rows = rows[rows < flat.numel()]
    if expert == 8:
        assert rows.numel() == 0                                      # past the last expert
    else:
        assert rows.numel() > 0 and bool((flat[rows.long()] == expert).all())
assert experts.tolist()[:3] == [0, 2, 5]
print("ok")
"""


@pytest.fixture(scope="module")
def triton_moe_results(kernel_test_device):
    need(importlib.util.find_spec("triton") is not None, "triton is not installed")
    return run_cases_script(HERE / "moe_cases.py", kernel_test_device, TRITON_CASES, RESULT_PREFIX)


@pytest.mark.parametrize("case", TRITON_CASES, ids=[case["id"] for case in TRITON_CASES])
def test_triton_matches_reference_float32(case, triton_moe_results):
    results, proc = triton_moe_results
    assert case["id"] in results, (
        f"the child stopped before {case['id']} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    assert results[case["id"]] is None, results[case["id"]]
