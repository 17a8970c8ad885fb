"""Inputs of the fused-MoE kernel tests, and the child process that runs the
Triton cases (the interpreter is switched on before triton is imported, and
an interpreter crash fails the cases instead of killing pytest).

Usage (test_fused_moe.py does this):  python moe_cases.py DEVICE < cases.json
prints one line ``@@MOE {"id": ..., "error": null | str}`` per case.
"""

from __future__ import annotations

import sys

RESULT_PREFIX = "@@MOE "


def make_inputs(case: dict, dtype=None, device: str = "cpu"):
    """(hidden, w_gate_up, w_down, topk_weights, topk_ids) of a case:
    {"T", "H", "I", "E", "k", "seed"} and optionally "unused" (experts no token picks)."""
    import torch

    dtype = dtype or torch.float32
    g = torch.Generator().manual_seed(case["seed"])
    tokens, hidden, width, experts, k = case["T"], case["H"], case["I"], case["E"], case["k"]
    x = torch.randn(tokens, hidden, generator=g)
    w_gate_up = torch.randn(experts, 2 * width, hidden, generator=g) / hidden ** 0.5
    w_down = torch.randn(experts, hidden, width, generator=g) / width ** 0.5
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, case.get("unused", [])] = float("-inf")
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    weights /= weights.sum(dim=-1, keepdim=True)
    tensors = [t.to(dtype) for t in (x, w_gate_up, w_down)]
    return [t.to(device) for t in (*tensors, weights, ids)]


def _run_case(case: dict, device: str) -> str | None:
    import torch

    from kernels.fused_moe_triton import fused_moe
    from kernels.reference import fused_moe_reference

    inputs = make_inputs(case, device=device)
    out = fused_moe(*inputs, config=case.get("config"))
    expected = fused_moe_reference(*[t.cpu() for t in inputs])
    try:
        torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=1e-5)
    except AssertionError as exc:
        return str(exc)
    return None


def main(device: str) -> None:
    from kernel_subprocess import serve_cases

    serve_cases(device, RESULT_PREFIX, lambda case: _run_case(case, device))

if __name__ == "__main__":
    main(sys.argv[1])
