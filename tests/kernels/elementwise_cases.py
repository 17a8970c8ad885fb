"""Inputs and bounds of the element-wise Triton kernel tests
(kernels/elementwise_triton.py), and the child process that runs them (the
interpreter is switched on before triton is imported, and an interpreter
crash fails the cases instead of killing pytest).

Usage (test_elementwise_triton.py does this):  python elementwise_cases.py DEVICE < cases.json
prints one line ``@@ELEM {"id": ..., "error": null | str}`` per case. DEVICE
cpu runs the interpreter, cuda the GPU, sm90 compiles the kernels for an
H100-class GPU instead (kernel_compile.py: the real compiler, no GPU needed).

The bounds, against the references (kernels/reference.py) on the same device:

* rms_norm: the residual bit for bit.  The mean of squares sums in another
  order, so the normalized value (before the weight) may differ: by at most
  one unit in the last place in bf16 / fp16, NORM_ULPS_FP32 in float32; the
  output must be the weight times such a value, rounded as torch rounds it.
* rope: bit for bit, in place (the rest of the qkv buffer untouched).
* silu_and_mul / gelu_tanh_and_mul: bit for bit on a GPU (libdevice's expf /
  tanhf, as torch's CUDA kernels); under the interpreter (another exp) within
  ACT_ULPS_FP32 fp32 units of |gate * up| + |out|.
* dispatch (GPU): the module-level functions give the Triton kernels' results
  for bf16 / fp16 (RoPE in place) and keep the reference for float32.
"""

from __future__ import annotations

import sys

RESULT_PREFIX = "@@ELEM "
NORM_ULPS_FP32 = 8  # random rows stay within 3; the sums' worst case is a few more
ACT_ULPS_FP32 = 8
INT_VIEW = {"float32": "int32", "bfloat16": "int16", "float16": "int16"}


def _bits(t):
    import torch

    return t.contiguous().view(getattr(torch, INT_VIEW[str(t.dtype).removeprefix("torch.")]))


def same_bits(got, expected, what: str) -> str | None:
    """None if got and expected are the same tensor bit for bit (signed zeros too)."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"{what}: got {tuple(got.shape)} {got.dtype}, expected {tuple(expected.shape)} {expected.dtype}"
    differ = _bits(got) != _bits(expected)
    if not bool(differ.any()):
        return None
    where = tuple(int(i) for i in differ.nonzero()[0])
    return (f"{what}: {int(differ.sum())} of {differ.numel()} differ, first at {where}: "
            f"{got[where].item()!r} vs {expected[where].item()!r}")


def check_rms_norm(out, x_sum, weight, eps: float, ulps: int) -> str | None:
    """None if out = weight * n (rounded as torch rounds it) with n within `ulps`
    units in the last place of the reference's normalized value of x_sum."""
    import torch

    x32 = x_sum.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x_sum.dtype)
    ok = torch.zeros(out.shape, dtype=torch.bool, device=out.device)
    for step in range(-ulps, ulps + 1):  # neighbours: the bit pattern +- step (same sign)
        near = (_bits(normed) + step).view(normed.dtype)
        ok |= _bits(weight * near) == _bits(out)
    if bool(ok.all()):
        return None
    where = tuple(int(i) for i in (~ok).nonzero()[0])
    expected = weight * normed
    return (f"rms_norm: {int((~ok).sum())} outside {ulps} ulp(s), first at {where}: "
            f"{out[where].item()!r} vs {expected[where].item()!r}")


def check_act(out, expected, x, ulps: int) -> str | None:
    """None if |out - expected| <= ulps fp32 units of |gate * up| + |expected|."""
    gate, up = x.double().chunk(2, dim=-1)
    bound = ulps * 2.0 ** -24 * ((gate * up).abs() + expected.double().abs())
    error = (out.double() - expected.double()).abs()
    if bool((error <= bound).all()):
        return None
    worst = divmod(int((error - bound).argmax()), error.shape[1])
    return f"|error| {error[worst].item():.3g} > bound {bound[worst].item():.3g} at {worst}"


def _inputs(case: dict, device: str):
    import torch

    g = torch.Generator().manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    return randn, g, dtype


def _rms_case(case: dict, device: str) -> str | None:
    """rms_norm with and without the residual, x a view into a wider buffer."""
    import torch

    from kernels import elementwise_triton as et
    from kernels.reference import rms_norm_reference

    randn, _, dtype = _inputs(case, device)
    rows, width = case["T"], case["H"]
    x = randn(rows, width + 64, scale=2.0)[:, :width]  # a row stride past the width
    residual, weight, eps = randn(rows, width, scale=4.0), randn(width), 1e-6
    ulps = NORM_ULPS_FP32 if dtype == torch.float32 else 1
    error = check_rms_norm(et.rms_norm(x, weight, eps), x, weight, eps, ulps)
    if error is not None:
        return f"no residual: {error}"
    mine, theirs = residual.clone(), residual.clone()
    out = et.rms_norm(x, weight, eps, mine)
    rms_norm_reference(x, weight, eps, theirs)
    return same_bits(mine, theirs, "residual") or check_rms_norm(out, mine, weight, eps, ulps)


def _rope_case(case: dict, device: str) -> str | None:
    """rope over q | k of a fused qkv output (a token stride past q and k), in place."""
    import torch

    from kernels import elementwise_triton as et
    from kernels.reference import rope_reference

    randn, g, dtype = _inputs(case, device)
    tokens, heads, kv_heads, dim = case["T"], case["heads"], case["kv_heads"], case["dim"]
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim)
    before = qkv.clone()
    qk = qkv[:, :(heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    positions = torch.randint(0, 100_000, (tokens, 1), generator=g).double()
    freqs = positions * 10000.0 ** (-torch.arange(0, dim, 2).double() / dim)
    emb = torch.cat((freqs, freqs), dim=-1)  # HF's table: both halves the same angles
    cos, sin = emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
    expected = rope_reference(qk.clone(), cos, sin)
    got = et.rope(qk, cos, sin)
    if got.data_ptr() != qk.data_ptr():
        return "rope: not in place"
    v_cols = (heads + kv_heads) * dim
    return same_bits(got, expected, "rope") or same_bits(qkv[:, v_cols:], before[:, v_cols:], "v")


def _act_case(case: dict, device: str) -> str | None:
    """silu_and_mul and gelu_tanh_and_mul, x a view into a wider buffer."""
    from kernels import elementwise_triton as et
    from kernels.reference import gelu_tanh_and_mul_reference, silu_and_mul_reference

    randn, _, _ = _inputs(case, device)
    x = randn(case["T"], 2 * case["W"] + 32, scale=3.0)[:, :2 * case["W"]]
    for name, op, reference in (("silu_and_mul", et.silu_and_mul, silu_and_mul_reference),
                                ("gelu_tanh_and_mul", et.gelu_tanh_and_mul, gelu_tanh_and_mul_reference)):
        got, expected = op(x), reference(x)
        if device == "cpu":
            error = check_act(got, expected, x, ACT_ULPS_FP32)
        else:
            error = same_bits(got, expected, name)
        if error is not None:
            return f"{name}: {error}"
    return None


def _dispatch_case(case: dict, device: str) -> str | None:
    """The module-level functions take Triton's kernels for bf16 / fp16 (RoPE
    in place), the references for float32."""
    import torch

    import kernels
    from kernels import elementwise_triton as et

    randn, _, dtype = _inputs(case, device)
    x, w, cos, sin = randn(3, 256), randn(256), randn(3, 64), randn(3, 64)
    qk = randn(3, 4, 64)
    triton_path = dtype != torch.float32
    if (kernels.rope(qk, cos, sin).data_ptr() == qk.data_ptr()) != triton_path:
        return f"rope: in place {not triton_path}, expected {triton_path}"
    ops = ((kernels.rms_norm(x, w, 1e-6), et.rms_norm(x, w, 1e-6), "rms_norm"),
           (kernels.silu_and_mul(x), et.silu_and_mul(x), "silu_and_mul"),
           (kernels.gelu_tanh_and_mul(x), et.gelu_tanh_and_mul(x), "gelu_tanh_and_mul"))
    for got, triton_out, name in ops if triton_path else ():
        error = same_bits(got, triton_out, name)
        if error is not None:
            return error
    return None


def _run_compile(case: dict) -> str | None:
    """Each kernel through the real compiler for sm_90, in bf16."""
    from kernel_compile import _compile
    from kernels import elementwise_triton as et

    t = "*bf16"
    norm = dict(x_ptr=t, r_ptr=t, w_ptr=t, out_ptr=t, eps="fp32")
    for one_pass in (True, False):
        for residual in (False, True):
            _compile(et._rms_norm_kernel, norm, dict(HAS_RESIDUAL=residual, BLOCK=4096 if one_pass else 8192,
                                                     ONE_PASS=one_pass), 90, num_warps=8)
    _compile(et._rope_kernel, dict(x_ptr=t, cos_ptr=t, sin_ptr=t), dict(HALF=64, HALF_PAD=64, BLOCK_H=8),
             90, enable_fp_fusion=False)
    _compile(et._rope_kernel, dict(x_ptr=t, cos_ptr=t, sin_ptr=t), dict(HALF=40, HALF_PAD=64, BLOCK_H=8),
             90, enable_fp_fusion=False)
    for gelu in (False, True):
        _compile(et._act_and_mul_kernel, dict(x_ptr=t, out_ptr=t),
                 dict(GELU=gelu, LIBDEVICE=True, BLOCK=et.ACT_BLOCK), 90, num_warps=4)
    return None


RUNNERS = {"rms_norm": _rms_case, "rope": _rope_case, "act": _act_case, "dispatch": _dispatch_case}


def main(device: str) -> None:
    from kernel_subprocess import serve_cases

    serve_cases(device, RESULT_PREFIX, lambda case: _run_compile(case) if device == "sm90"
                else RUNNERS[case["kernel"]](case, device))

if __name__ == "__main__":
    main(sys.argv[1])
