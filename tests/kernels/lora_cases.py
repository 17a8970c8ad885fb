"""Inputs and bounds of the multi-LoRA kernel tests (kernels/lora.py), and the
child process that runs the Triton cases (the interpreter is switched on
before triton is imported, and an interpreter crash fails the cases instead
of killing pytest).

Usage (test_lora_triton.py does this):  python lora_cases.py DEVICE < cases.json
prints one line ``@@LORA {"id": ..., "error": null | str}`` per case. DEVICE
cpu runs the interpreter, cuda the GPU, sm90 compiles the kernels for an
H100-class GPU instead (kernel_compile.py: the real compiler, no GPU needed).

The bound: a dot product of K fp32 products summed in fp32 in any order is
within gamma_K * sum_i |a_i b_i| of the exact one (gamma_K ~ K * 2**-24), so
two such sums (a kernel's and the reference's) differ by at most twice that.
A bf16 or fp16 output rounds each side once more: half a unit in the last
place of each, at most 2**-8 (bf16) or 2**-11 (fp16) of its magnitude.
"""

from __future__ import annotations

import sys

RESULT_PREFIX = "@@LORA "
SLOTS = 3
HALF_ULP = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


def make_ids(tokens: int, slots: int, generator):
    """[tokens] int32 slot ids in runs of 1 to 16 rows (a prefill chunk is one
    sequence), -1 (no adapter) among them; a lone row gets a slot."""
    import torch

    ids = torch.empty(tokens, dtype=torch.int32)
    t = 0
    while t < tokens:
        length = int(torch.randint(1, 17, (1,), generator=generator))
        ids[t:t + length] = int(torch.randint(-1, slots, (1,), generator=generator))
        t += length
    if tokens == 1:
        ids[0] = slots - 1
    return ids


def make_inputs(tokens: int, rank: int, width: int, dtype, seed: int, out: int | None = None,
                blocks: int = 1):
    """x [T, width], A [S, blocks * R, width], y [T, out], B [S, out, R] (out =
    width unless given) in dtype, ids [T]: values of about 1, sums of about 1.
    blocks > 1: a fused projection's A (a rank block per slice) and compact B."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = width if out is None else out
    x = torch.randn(tokens, width, generator=g).to(dtype)
    a = (torch.randn(SLOTS, blocks * rank, width, generator=g) / width ** 0.5).to(dtype)
    y = torch.randn(tokens, out, generator=g).to(dtype)
    b = (torch.randn(SLOTS, out, rank, generator=g) / rank ** 0.5).to(dtype)
    return x, a, y, b, make_ids(tokens, SLOTS, g)


def block_diagonal(b, slices):
    """A compact B [S, out, R] with `slices` as the padded form [S, out, n * R]:
    slice i's rows in column block i, zeros elsewhere (the same products)."""
    import torch

    rank, n = b.shape[2], len(slices) - 1
    padded = torch.zeros(b.shape[0], b.shape[1], n * rank, dtype=b.dtype)
    for i, (start, stop) in enumerate(zip(slices, slices[1:])):
        padded[:, start:stop, i * rank:(i + 1) * rank] = b[:, start:stop]
    return padded


def _magnitude(rows, stack, ids, base=None):
    """Per output, sum |w| |v| of its dot product (plus |base|): what its rounding scales with."""
    import torch

    mag = torch.zeros(rows.shape[0], stack.shape[1], dtype=torch.float64)
    for t, slot in enumerate(ids.tolist()):
        if slot >= 0:
            mag[t] = stack[slot].double().abs() @ rows[t].double().abs()
    return mag if base is None else mag + base.double().abs()


def check_close(got, expected, rows, stack, ids, base=None, scale: float = 1.0) -> str | None:
    """None if got is within the module docstring's bound of expected (both
    sums over `rows` . `stack` in fp32, rounded to got's dtype)."""
    gamma = stack.shape[2] * 2.0 ** -24
    bound = 2.1 * gamma * abs(scale) * _magnitude(rows, stack, ids, base) + 2.0 ** -60
    half = HALF_ULP[str(got.dtype).removeprefix("torch.")]  # the last rounding (scale, y's add, dtype)
    bound = bound + half * (got.double().abs() + expected.double().abs())
    error = (got.double() - expected.double()).abs()
    if bool((error <= bound).all()):
        return None
    worst = int((error - bound).argmax())
    return (f"|error| {error.view(-1)[worst].item():.3g} > bound {bound.view(-1)[worst].item():.3g} "
            f"at {divmod(worst, got.shape[1])} (expected {expected.view(-1)[worst].item():.4g})")


def _run_case(case: dict, device: str) -> str | None:
    """Triton's shrink and expand against the references on the same inputs."""
    import torch

    from kernels import lora_triton
    from kernels.lora import lora_expand_reference, lora_shrink_reference

    dtype = getattr(torch, case["dtype"])
    slices = case.get("slices")
    x, a, y, b, ids = make_inputs(case["T"], case["R"], case["width"], dtype, case["seed"], case.get("out"),
                                  blocks=len(slices) - 1 if slices else 1)
    scale = 0.5
    h = lora_triton.lora_shrink(x.to(device), a.to(device), ids.to(device), scale).cpu()
    error = check_close(h, lora_shrink_reference(x, a, ids, scale), x, a, ids, scale=scale)
    if error is not None:
        return f"shrink: {error}"
    h = lora_shrink_reference(x, a, ids, scale)
    got = lora_triton.lora_expand(y.clone().to(device), h.to(device), b.to(device), ids.to(device),
                                  slices).cpu()
    padded = b if slices is None else block_diagonal(b, slices)  # the bound's magnitudes
    error = check_close(got, lora_expand_reference(y.clone(), h, b, ids, slices), h, padded, ids, base=y)
    if error is not None:
        return f"expand: {error}"
    if not torch.equal(got[ids < 0], y[ids < 0]):
        return "expand: a row with id -1 changed"
    return None


def _run_compile(case: dict) -> str | None:
    """Both kernels through the real compiler for sm_90, in the case's dtype."""
    from kernel_compile import TRITON_TYPES, _compile
    from kernels import lora_triton as lt

    import torch

    t = "*" + TRITON_TYPES[getattr(torch, case["dtype"])]
    ids = "*i32" if case["ids"] == "int32" else "*i64"
    _compile(lt._shrink_kernel, dict(x_ptr=t, a_ptr=t, ids_ptr=ids, h_ptr="*fp32", scale="fp32"),
             dict(BLOCK_R=lt.MAX_BLOCK_RANK, BLOCK_K=lt.BLOCK_K), 90)
    for sliced in (False, True):
        _compile(lt._expand_kernel, dict(y_ptr=t, h_ptr="*fp32", b_ptr=t, ids_ptr=ids, strips_ptr="*i32"),
                 dict(BLOCK_N=lt.BLOCK_OUT, BLOCK_R=lt.MAX_BLOCK_RANK, SLICED=sliced), 90)
    return None


def main(device: str) -> None:
    from kernel_subprocess import serve_cases

    serve_cases(device, RESULT_PREFIX,
                lambda case: _run_compile(case) if device == "sm90" else _run_case(case, device))

if __name__ == "__main__":
    main(sys.argv[1])
