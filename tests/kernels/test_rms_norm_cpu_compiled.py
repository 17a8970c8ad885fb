"""The compiled RMSNorm with its residual add (kernels/cpu/csrc/rms_norm.h)
against HF's arithmetic (kernels.reference.rms_norm_reference) on fresh random
inputs, and kernels.rms_norm's choice of path."""

import pytest
import torch

import kernels
from kernels.cpu import ops as cpu_ops
from kernels.reference import rms_norm_reference

SHAPES = ((1, 576), (3, 64), (17, 100), (40, 1536))  # (tokens, dim); 40 rows span threads


@pytest.fixture(scope="module")
def ops(compiled_cpu_ops):
    return compiled_cpu_ops


def _inputs(seed, tokens, dim, dtype):
    generator = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(2, tokens, dim, generator=generator) * 3).to(dtype).unbind(0)
    weight = torch.randn(dim, generator=generator).to(dtype)
    return x.contiguous(), residual.contiguous(), weight


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bfloat16_matches_hf_arithmetic(ops, shape, with_residual, session_seed):
    x, residual, weight = _inputs(session_seed, *shape, torch.bfloat16)
    ours_residual, ref_residual = residual.clone(), residual.clone()
    out = ops.rms_norm(x, weight, 1e-5, ours_residual if with_residual else None)
    expected = rms_norm_reference(x, weight, 1e-5, ref_residual if with_residual else None)
    # The residual add is one rounded add, as torch's: identical.
    assert torch.equal(ours_residual, ref_residual)
    # Only the mean's summation order differs, so the normalized value (rounded
    # to bf16 before the weight multiplies it, as HF does) may move by one bf16
    # step, rarely; the weight scales that step and the product is rounded again.
    normalized = rms_norm_reference(x, torch.ones_like(weight), 1e-5,
                                    residual.clone() if with_residual else None)
    bound = bf16_step(expected) + weight.double().abs() * bf16_step(normalized)
    assert ((out.double() - expected.double()).abs() <= bound).all(), f"seed {session_seed}"
    assert (out == expected).float().mean() > 0.99


def bf16_step(values: torch.Tensor) -> torch.Tensor:
    """The distance from each value to the next bf16 of larger magnitude (8 significant bits)."""
    return 2.0 ** (torch.frexp(values.double())[1] - 8)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_float32_matches_to_rounding(ops, shape, session_seed):
    x, residual, weight = _inputs(session_seed, *shape, torch.float32)
    ours_residual, ref_residual = residual.clone(), residual.clone()
    out = ops.rms_norm(x, weight, 1e-6, ours_residual)
    expected = rms_norm_reference(x, weight, 1e-6, ref_residual)
    assert torch.equal(ours_residual, ref_residual)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_a_token_gets_the_same_numbers_in_any_batch(ops, session_seed):
    x, residual, weight = _inputs(session_seed, 40, 576, torch.bfloat16)
    whole = ops.rms_norm(x, weight, 1e-5, residual.clone())
    for row in (0, 17, 39):
        alone = ops.rms_norm(x[row:row + 1].clone(), weight, 1e-5, residual[row:row + 1].clone())
        assert torch.equal(alone[0], whole[row])


@pytest.mark.parametrize("args, message", [
    (lambda x, w, r: (x.t(), w, r), "contiguous CPU"),
    (lambda x, w, r: (x, w[:-1], r), "weight must be"),
    (lambda x, w, r: (x, w, r[:1]), "residual must be"),
    (lambda x, w, r: (x.half(), w.half(), None), "float32 or bf16"),
])
def test_bad_inputs_are_refused(ops, args, message):
    x, residual, weight = _inputs(0, 4, 32, torch.bfloat16)
    x, weight, residual = args(x, weight, residual)
    with pytest.raises(RuntimeError, match=message):
        ops.rms_norm(x, weight, 1e-5, residual)


def test_kernels_rms_norm_takes_the_op_for_bf16_only(ops, session_seed):
    x, residual, weight = _inputs(session_seed, 5, 64, torch.bfloat16)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-5), ops.rms_norm(x, weight, 1e-5, None))
    # float32: the reference itself, bit for bit (HF parity relies on it).
    x32, r32, w32 = x.float(), residual.float(), weight.float()
    a, b = r32.clone(), r32.clone()
    assert torch.equal(kernels.rms_norm(x32, w32, 1e-5, a), rms_norm_reference(x32, w32, 1e-5, b))
    assert torch.equal(a, b)
    assert kernels.get_backend("torch").rms_norm is rms_norm_reference


def test_turned_off_means_the_reference(monkeypatch, session_seed):
    monkeypatch.setenv(cpu_ops.ENV_VAR, "off")
    x, residual, weight = _inputs(session_seed, 3, 64, torch.bfloat16)
    a, b = residual.clone(), residual.clone()
    assert torch.equal(kernels.rms_norm(x, weight, 1e-5, a), rms_norm_reference(x, weight, 1e-5, b))
    assert torch.equal(a, b)
