"""The compiled bf16-weight linear (kernels/cpu/csrc/linear.h) against float64
matmuls on fresh random inputs, and kernels.linear's choice of path.

Shapes cross every edge of the op's blocking: token counts around its
panels (6 or 8 rows) and its 120-token chunks, output features around its
tiles and strips (32 or 48 rows), in_features of one pair and of SmolLM2's
layers.
"""

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.cpu import ops as cpu_ops
from kernels.reference import linear_reference

TOKENS = (1, 2, 3, 4, 5, 7, 131)
FEATURES = ((32, 1), (32, 3), (64, 33), (576, 65), (1536, 40))  # (in, out)


@pytest.fixture(scope="module")
def ops(compiled_cpu_ops):
    return compiled_cpu_ops


def _inputs(generator, tokens, in_features, out_features, dtype, bias):
    x = torch.randn(tokens, in_features, generator=generator).to(dtype)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    b = torch.randn(out_features, generator=generator) if bias else None
    return x, weight, b


def _expected(x, weight, bias):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("features", FEATURES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_float32_activations_match_float64(ops, tokens, features, bias, session_seed):
    generator = torch.Generator().manual_seed(session_seed + tokens)
    x, weight, b = _inputs(generator, tokens, *features, torch.float32, bias)
    out = ops.linear_bf16(x, weight, b)
    assert out.dtype == torch.float32 and out.shape == (tokens, features[1])
    # fp32 accumulation of in_features products: error grows with the sum of |terms|.
    scale = F.linear(x.double().abs(), weight.double().abs()) + 1
    error = (out.double() - _expected(x, weight, b)).abs() / scale
    assert error.max() < 1e-6, f"seed {session_seed}: relative error {error.max():.2e}"


@pytest.mark.parametrize("features", FEATURES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_bfloat16_activations_round_once(ops, tokens, features, session_seed):
    """bf16 in, bf16 out: the fp32 sum rounded once, so within half a bf16
    step (plus the fp32 sum's own error)."""
    generator = torch.Generator().manual_seed(session_seed + 7 * tokens)
    x, weight, b = _inputs(generator, tokens, *features, torch.bfloat16, True)
    out = ops.linear_bf16(x, weight, b)
    assert out.dtype == torch.bfloat16
    expected = _expected(x, weight, b)
    step = 2.0 ** (torch.frexp(expected)[1] - 8).double()  # one bf16 ulp at each value
    fp32_error = 1e-6 * (F.linear(x.double().abs(), weight.double().abs()) + b.double().abs())
    assert ((out.double() - expected).abs() <= 0.5 * step + fp32_error).all(), f"seed {session_seed}"


@pytest.mark.parametrize("tokens", (1, 9, 131))
def test_float_out_is_the_sum_before_its_bf16_rounding(ops, tokens, session_seed):
    """bf16 in, float32 out (the logits): the same fp32 sums, not rounded."""
    generator = torch.Generator().manual_seed(session_seed + 11 * tokens)
    x, weight, b = _inputs(generator, tokens, 576, 65, torch.bfloat16, True)
    out = ops.linear_bf16(x, weight, b, True)
    assert out.dtype == torch.float32
    scale = F.linear(x.double().abs(), weight.double().abs()) + b.double().abs() + 1
    error = (out.double() - _expected(x, weight, b)).abs() / scale
    assert error.max() < 1e-6, f"seed {session_seed}: relative error {error.max():.2e}"
    assert torch.equal(out.to(torch.bfloat16), ops.linear_bf16(x, weight, b))


def test_rows_never_mix(ops, session_seed):
    """A NaN in one token's activations poisons that token's outputs only."""
    generator = torch.Generator().manual_seed(session_seed)
    x, weight, _ = _inputs(generator, 9, 64, 70, torch.float32, False)
    x[5, 17] = float("nan")
    out = ops.linear_bf16(x, weight, None)
    assert out[5].isnan().all()
    keep = [i for i in range(9) if i != 5]
    assert torch.equal(out[keep], ops.linear_bf16(x[keep], weight, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_gets_the_same_numbers_in_any_batch(ops, dtype, session_seed):
    """Batching must not change a sequence's logits: every token's dot
    products run in the same order whatever panel or chunk it lands in (bf16
    tokens take the dot-product tiles on CPUs that have them)."""
    generator = torch.Generator().manual_seed(session_seed)
    x, weight, b = _inputs(generator, 133, 576, 67, dtype, True)
    whole = ops.linear_bf16(x, weight, b)
    for row in (0, 3, 4, 128, 132):
        assert torch.equal(ops.linear_bf16(x[row:row + 1], weight, b)[0], whole[row])


def test_empty_inputs(ops):
    weight = torch.ones(5, 32, dtype=torch.bfloat16)
    assert ops.linear_bf16(torch.ones(0, 32), weight, None).shape == (0, 5)


@pytest.mark.parametrize("x, weight, message", [
    (torch.ones(2, 32), torch.ones(4, 32), "weight must be contiguous bf16"),
    (torch.ones(2, 32), torch.ones(4, 48, dtype=torch.bfloat16), "x \\[tokens, in\\]"),
    (torch.ones(2, 32, dtype=torch.float64), torch.ones(4, 32, dtype=torch.bfloat16),
     "float32 or bf16"),
    (torch.ones(2, 8), torch.ones(4, 8, dtype=torch.bfloat16), "not a multiple of"),
])
def test_bad_inputs_are_refused(ops, x, weight, message):
    with pytest.raises(RuntimeError, match=message):
        ops.linear_bf16(x, weight, None)


def test_kernels_linear_takes_the_op_for_bf16_weights_only(ops, session_seed):
    generator = torch.Generator().manual_seed(session_seed)
    x, weight, b = _inputs(generator, 6, 64, 40, torch.bfloat16, True)
    assert torch.equal(kernels.linear(x, weight, b), ops.linear_bf16(x, weight, b))
    # Any leading shape, as F.linear takes it.
    batched = kernels.linear(x.view(2, 3, 64), weight, b)
    assert torch.equal(batched, ops.linear_bf16(x, weight, b).view(2, 3, 40))
    assert torch.equal(kernels.linear(x, weight, b, float_out=True),
                       ops.linear_bf16(x, weight, b, True))
    # float32 weights: F.linear itself, bit for bit (HF parity in float32 relies on it).
    x32, w32 = x.float(), weight.float()
    assert torch.equal(kernels.linear(x32, w32, b), F.linear(x32, w32, b))
    assert torch.equal(kernels.linear(x32, w32, b, float_out=True), F.linear(x32, w32, b))
    # An in_features no build divides: F.linear.
    odd_x, odd_w = torch.randn(3, 24).bfloat16(), torch.randn(5, 24).bfloat16()
    assert cpu_ops.ops_for(24) is None
    assert torch.equal(kernels.linear(odd_x, odd_w), F.linear(odd_x, odd_w))
    assert kernels.get_backend("torch").linear is linear_reference
    wide = linear_reference(x, weight, b.bfloat16(), float_out=True)
    assert wide.dtype == torch.float32 and torch.equal(wide, F.linear(x, weight, b.bfloat16()).float())


def test_turned_off_means_f_linear(monkeypatch, session_seed):
    monkeypatch.setenv(cpu_ops.ENV_VAR, "off")
    generator = torch.Generator().manual_seed(session_seed)
    x, weight, b = _inputs(generator, 3, 64, 8, torch.bfloat16, True)
    b = b.bfloat16()
    assert torch.equal(kernels.linear(x, weight, b), F.linear(x, weight, b))
