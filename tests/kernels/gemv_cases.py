"""Inputs and bounds of the decode GEMV tests (kernels/gemv_triton.py), and
the child process that runs them (the interpreter is switched on before
triton is imported; an interpreter crash fails the cases, not pytest).

Usage (test_gemv_triton.py does this):  python gemv_cases.py DEVICE < cases.json
prints one line ``@@GEMV {"id": ..., "error": null | str}`` per case. DEVICE
cpu runs the interpreter (float32), cuda the GPU (bf16 and fp16 too), sm90
compiles the kernels for an H100-class GPU (kernel_compile.py, no GPU needed).

The bound, as lora_cases.py's: two fp32 sums of K products in any order
differ by at most 2 * gamma_K * sum_k |x_k w_k| (gamma_K ~ K * 2**-24); a
bf16 / fp16 output rounds each side once more (half a unit in its last place).
"""

from __future__ import annotations

import sys

RESULT_PREFIX = "@@GEMV "
HALF_ULP = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


def make_inputs(case: dict):
    """x [M, K] (a column slice of a wider buffer when case["strided"]), W [N, K],
    bias [N] or None, in the case's dtype; values of about 1, sums of about 1."""
    import torch

    g = torch.Generator().manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    rows, n, k = case["M"], case["N"], case["K"]
    x = torch.randn(rows, k + 8 * case.get("strided", 0), generator=g).to(dtype)[:, :k]
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if case["bias"] else None
    return x, w, bias


def check_close(got, x, w, bias) -> str | None:
    """None if got is within the docstring's bound of the exact product."""
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    bound = 2.1 * x.shape[1] * 2.0 ** -24 * magnitude + 2.0 ** -60
    bound = bound + HALF_ULP[str(got.dtype).removeprefix("torch.")] * (got.double().abs() + exact.abs())
    error = (got.double() - exact).abs()
    if bool((error <= bound).all()):
        return None
    worst = int((error - bound).argmax())
    return (f"|error| {error.view(-1)[worst].item():.3g} > bound {bound.view(-1)[worst].item():.3g} "
            f"at {divmod(worst, got.shape[1])}")


def _run_case(case: dict, device: str) -> str | None:
    """Every candidate tiling for the case's row count against the exact product."""
    import torch

    from kernels import gemv_triton as gt

    x, w, bias = make_inputs(case)
    configs = gt.ONE_ROW if case["M"] == 1 else gt.FEW_ROWS
    for config in configs:
        got = gt.gemv(x.to(device), w.to(device), None if bias is None else bias.to(device),
                      case["float_out"], config).cpu()
        want = torch.float32 if case["float_out"] else x.dtype
        if got.dtype != want or got.shape != (x.shape[0], w.shape[0]):
            return f"{config}: {got.dtype} {tuple(got.shape)}, expected {want}"
        error = check_close(got, x, w, bias)
        if error is not None:
            return f"{config}: {error}"
    return None


def _run_tuner(case: dict, device: str) -> str | None:
    """DecodeGemv: a choice per (bucket, shape), kept; a Triton choice's output
    within the bound, a cuBLAS choice's (it may win a small shape's timing) and
    more rows than MAX_ROWS equal to the reference bit for bit (cuBLAS rounds
    a bf16 product before adding the bias: two roundings, past the bound)."""
    import torch

    from kernels import gemv_triton as gt
    from kernels.reference import linear_reference

    tuner = gt.DecodeGemv()
    x, w, bias = (t if t is None else t.to(device) for t in make_inputs(case))
    for rows in (1, 3, 4, 8):
        got = tuner.linear(x[:rows], w, bias)
        choice = [c for key, c in tuner.choices.items() if key[0] == gt.rows_bucket(rows)]
        if choice == [None]:
            error = None if torch.equal(got, linear_reference(x[:rows], w, bias)) else "cuBLAS: not its product"
        else:
            error = check_close(got.cpu(), x[:rows].cpu(), w.cpu(), None if bias is None else bias.cpu())
        if error is not None:
            return f"{rows} rows ({choice}): {error}"
    if sorted(key[0] for key in tuner.choices) != [1, 4, 8]:
        return f"choices {sorted(tuner.choices)}: expected the buckets 1, 4, 8"
    many = torch.cat([x] * 2)[:9]
    if not torch.equal(tuner.linear(many, w, bias), linear_reference(many, w, bias)):
        return "9 rows: not cuBLAS's product"
    return None


def _run_compile(case: dict) -> str | None:
    """Both kernels through the real compiler for sm_90 in the case's dtype."""
    import torch

    from kernel_compile import TRITON_TYPES, _compile
    from kernels import gemv_triton as gt

    t = "*" + TRITON_TYPES[getattr(torch, case["dtype"])]
    out = "*fp32" if case["partial"] or case["float_out"] else t
    for one_row in (True, False):
        _compile(gt._gemv_kernel, dict(x_ptr=t, w_ptr=t, bias_ptr=t, out_ptr=out),
                 dict(ONE_ROW=one_row, HAS_BIAS=True, PARTIAL=case["partial"], BLOCK_N=32,
                      BLOCK_K=256, DOT_M=gt.DOT_ROWS), 90, num_warps=4, num_stages=3)
    _compile(gt._split_sum_kernel, dict(partial_ptr="*fp32", bias_ptr=t, out_ptr=t),
             dict(SPLIT_K=4, HAS_BIAS=True, BLOCK=1024), 90)
    return None


def main(device: str) -> None:
    from kernel_subprocess import serve_cases

    def run(case):
        if device == "sm90":
            return _run_compile(case)
        return (_run_tuner if case.get("tuner") else _run_case)(case, device)

    serve_cases(device, RESULT_PREFIX, run)

if __name__ == "__main__":
    main(sys.argv[1])
