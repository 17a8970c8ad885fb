"""Cases of the Triton quantized-weight kernels (kernels/quant_triton.py), and
the child process that runs them: the interpreter is switched on before
triton is imported (on a CPU), and an interpreter crash fails the cases
instead of killing pytest.

Usage (test_quant_linear_triton.py does this):  python quant_cases.py DEVICE < cases.json
prints one line ``@@QUANT {"id": ..., "error": null | str}`` per case. With
DEVICE ``sm90`` the cases are compiled for an H100-class GPU instead
(kernel_compile.py: the real compiler, no GPU needed, no interpreter).

The bound: x @ W^T summed in float32 in any order is within
gamma_K * sum_i |x_i w_i| of the exact product (gamma_K ~ K * 2**-24), so
the kernel and the reference (de-quantize, then torch's matmul) differ by at
most twice that, plus one rounding each of the bias's addition; a float16
output adds one float16 rounding of each.
"""

from __future__ import annotations

import sys

RESULT_PREFIX = "@@QUANT "
ROWS = (1, 3, 16, 128)
OUT_FEATURES = 70  # one whole tile of 64 outputs and a partial one


def _width(type_name: str) -> int:
    """Several blocks: legacy types 5 (160 inputs: a partial last K-step),
    K-quants 2 super-blocks (8 K-steps of 64)."""
    from kernels.quant import QUANT_TYPES

    elems = QUANT_TYPES[type_name].block_elems
    return elems * (5 if elems == 32 else 2)


def make_blob(type_names, out_features: int, in_features: int, generator):
    """A blob of random valid blocks (extreme scales included); each part's
    first two rows all-zero blocks."""
    from kernels.quant import pack_quant_weight, random_quant_blocks

    parts = []
    for name in type_names:
        data = random_quant_blocks(name, out_features, in_features, generator)
        data[:2] = 0
        parts.append((name, data))
    return pack_quant_weight(parts, in_features)


def rounding_bound(x, weight, expected):
    """The float32 bound of the module docstring, per output."""
    unit = 2.0 ** -24
    K = x.shape[-1]
    gamma = K * unit / (1 - K * unit)
    magnitude = x.float().abs() @ weight.abs().t()
    return 2 * gamma * magnitude + 2 * unit * expected.abs()


def _check(got, x, weight, bias, where: str) -> str | None:
    """None if got is within the bound of the float32 reference."""
    import torch

    expected = x.float() @ weight.t() + (0 if bias is None else bias.float())
    bound = rounding_bound(x, weight, expected)
    if got.dtype == torch.float16:  # each side rounds once more, or overflows
        finite = expected.abs() <= 60000
        overflow = expected.abs() >= 70000
        if not bool((got[overflow].float() == expected[overflow].sign() * float("inf")).all()):
            return f"{where}: an output past float16's range is not +-inf"
        got, expected = got[finite], expected[finite]
        bound = bound[finite] * 1.001 + expected.abs() * 2.0 ** -10 + 2.0 ** -24
    error = (got.float() - expected).abs()
    if not bool((error <= bound).all()):
        worst = int((error - bound).argmax())
        return (f"{where}: |error| {error.view(-1)[worst].item():.3g} > bound "
                f"{bound.reshape(-1)[worst].item():.3g} (|y| {expected.view(-1)[worst].abs().item():.3g})")
    return None


def _run_type(case: dict, device: str) -> str | None:
    """One type: the de-quantized weights are gguf's bits; the product at
    every row count is within the bound."""
    import torch

    import kernels
    from kernels import quant_triton as qt
    from kernels.quant import dequantize_reference

    # On a GPU through kernels' own dispatch, which must pick these kernels.
    ops = kernels if device == "cuda" else qt
    generator = torch.Generator().manual_seed(case["seed"])
    name = case["type"]
    blob = make_blob([name], OUT_FEATURES, _width(name), generator)
    weight = dequantize_reference(blob)
    got = ops.quant_dequantize(blob.to(device)).cpu()
    if not got.view(torch.int32).equal(weight.view(torch.int32)):
        wrong = int((got.view(torch.int32) != weight.view(torch.int32)).sum())
        return f"dequantize: {wrong} of {weight.numel()} values are not gguf's bits"
    for rows in ROWS:
        x = torch.randn(rows, weight.shape[1], generator=generator)
        error = _check(ops.quant_linear(x.to(device), blob.to(device)).cpu(), x, weight, None,
                       f"{rows} rows")
        if error is not None:
            return error
    return None


def _run_mixed(case: dict, device: str) -> str | None:
    """A q|k|v-like blob of three types (each part its own launch, into its
    columns), with a bias: float32 out of float16 activations (the logits'
    float_out), float16 out, 3-D and strided activations."""
    import torch

    from kernels import quant_triton as qt
    from kernels.quant import dequantize_reference

    generator = torch.Generator().manual_seed(case["seed"])
    blob = make_blob(["Q4_K", "Q6_K", "Q8_0"], 37, 512, generator)
    weight = dequantize_reference(blob)
    bias = torch.randn(weight.shape[0], generator=generator)
    if not qt.quant_dequantize(blob.to(device)).cpu().view(torch.int32).equal(weight.view(torch.int32)):
        return "dequantize: the parts' values are not gguf's bits"
    rows = torch.tensor([110, 0, 40, 40, 73, 5])  # the last row, the first, a repeat, all three parts
    got = qt.quant_dequantize(blob.to(device), rows.to(device)).cpu()
    if not got.view(torch.int32).equal(weight[rows].view(torch.int32)):
        return "dequantize with rows: not those rows of the whole"
    dev = lambda t: t.to(device)  # noqa: E731
    x = torch.randn(2, 3, 512, generator=generator).half()
    runs = {
        "float16 in, float32 out": (x, qt.quant_linear(dev(x), dev(blob), dev(bias), float_out=True)),
        "float16 in and out": (x, qt.quant_linear(dev(x), dev(blob), dev(bias))),
    }
    wide = torch.randn(5, 700, generator=generator)  # a slice: rows 700 apart
    runs["strided rows"] = (wide[:, 100:612], qt.quant_linear(dev(wide)[:, 100:612], dev(blob), dev(bias)))
    for where, (inputs, got) in runs.items():
        if got.shape != (*inputs.shape[:-1], weight.shape[0]):
            return f"{where}: shape {tuple(got.shape)}"
        flat = inputs.reshape(-1, 512)
        error = _check(got.cpu().reshape(flat.shape[0], -1), flat, weight, bias, where)
        if error is not None:
            return error
    return None


def _run_compile(case: dict) -> str | None:
    """Both kernels of one type through the real compiler, for sm_90."""
    from kernel_compile import _compile
    from kernels import quant_triton as qt

    constants = dict(qt._type_constants(case["type"]), **qt._tiles(4096))
    pointers = dict(x_ptr="*bf16", w_ptr="*u8", bias_ptr="*bf16", out_ptr="*bf16",
                    stride_xm="i64", stride_om="i64")
    _compile(qt._quant_linear_kernel, pointers, dict(constants, HAS_BIAS=True, BLOCK_M=16), 90)
    _compile(qt._dequantize_kernel, dict(w_ptr="*u8", out_ptr="*fp32"), constants, 90)
    return None


def main(device: str) -> None:
    from kernel_subprocess import serve_cases

    runners = {"type": _run_type, "mixed": _run_mixed}
    serve_cases(device, RESULT_PREFIX, lambda case: _run_compile(case) if device == "sm90"
                else runners[case["kind"]](case, device))

if __name__ == "__main__":
    main(sys.argv[1])
