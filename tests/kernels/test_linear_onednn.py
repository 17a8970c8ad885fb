"""Float32 weights an encoder lets go of torch's matmul (kernels.pack_linear
with torch_float32=False): oneDNN's layout and matmul, against float64
matmuls on fresh random inputs, and the dispatch around them (decoders keep
torch's own float32 product, bf16 weights their packed layout)."""

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.activation import LINEAR_ACTIVATIONS

TOKENS = (1, 3, 16, 131)
FEATURES = ((32, 16), (96, 40), (768, 2304))  # (in, out)


def _inputs(generator, tokens, in_features, out_features):
    x = torch.randn(tokens, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    bias = torch.randn(out_features, generator=generator)
    return x, weight, bias


def _relative_error(out, x, weight, bias):
    """|out - exact| over what an fp32 sum's rounding grows with (the sum of |terms|)."""
    exact = F.linear(x.double(), weight.double(), bias.double())
    scale = F.linear(x.double().abs(), weight.double().abs()) + bias.double().abs() + 1
    return ((out.double() - exact).abs() / scale).max().item()


def test_torch_has_onednn():
    assert torch.backends.mkldnn.is_available(), "this torch build has no oneDNN"


@pytest.mark.parametrize("features", FEATURES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_onednn_linear_matches_float64(tokens, features, session_seed):
    generator = torch.Generator().manual_seed(session_seed + tokens)
    x, weight, bias = _inputs(generator, tokens, *features)
    packed = kernels.pack_linear(weight, torch_float32=False)
    assert packed.is_mkldnn
    out = kernels.linear(x, packed, bias)
    assert out.dtype == torch.float32 and out.shape == (tokens, features[1])
    error = _relative_error(out, x, weight, bias)
    assert error < 1e-6, f"seed {session_seed}: relative error {error:.2e}"


def test_onednn_linear_takes_any_leading_shape_no_bias_and_float_out(session_seed):
    generator = torch.Generator().manual_seed(session_seed)
    x, weight, bias = _inputs(generator, 6, 96, 40)
    packed = kernels.pack_linear(weight, torch_float32=False)
    flat = kernels.linear(x, packed, bias)
    assert torch.equal(kernels.linear(x.view(2, 3, 96), packed, bias), flat.view(2, 3, 40))
    assert torch.equal(kernels.linear(x, packed, bias, float_out=True), flat)
    no_bias = kernels.linear(x, packed)
    assert _relative_error(no_bias, x, weight, torch.zeros_like(bias)) < 1e-6
    wide = torch.randn(6, 192, generator=generator)
    wide[:, :96] = x
    assert _relative_error(kernels.linear(wide[:, :96], packed, bias), x, weight, bias) < 1e-6


def test_rows_never_mix(session_seed):
    generator = torch.Generator().manual_seed(session_seed)
    x, weight, bias = _inputs(generator, 9, 96, 40)
    x[5, 17] = float("nan")
    out = kernels.linear(x, kernels.pack_linear(weight, torch_float32=False), bias)
    assert out[5].isnan().all() and not out[[0, 1, 2, 3, 4, 6, 7, 8]].isnan().any()


def test_only_a_float32_weight_that_gives_up_torch_leaves_its_layout(session_seed):
    generator = torch.Generator().manual_seed(session_seed)
    weight = torch.randn(48, 64, generator=generator)
    assert kernels.pack_linear(weight) is weight  # a decoder's: torch's sums, HF's to the bit
    assert kernels.get_backend("torch").pack_linear(weight, torch_float32=False) is weight
    packed = kernels.pack_linear(weight, torch_float32=False)
    assert torch.equal(kernels.unpack_linear(packed), weight)
    bf16 = weight.bfloat16()
    assert torch.equal(kernels.unpack_linear(kernels.pack_linear(bf16, torch_float32=False)), bf16)
    assert not kernels.pack_linear(bf16, torch_float32=False).is_mkldnn


@pytest.mark.parametrize("activation", ("gelu", "gelu_pytorch_tanh", "relu"))
def test_the_activation_is_onednns_post_op(activation, session_seed):
    """An encoder's up projection: the activation fused into oneDNN's matmul,
    within float32 rounding of torch's activation of oneDNN's plain product."""
    generator = torch.Generator().manual_seed(session_seed)
    x, weight, bias = _inputs(generator, 16, 96, 40)
    packed = kernels.pack_linear(weight, torch_float32=False)
    out = kernels.linear(x, packed, bias, activation=activation)
    expected = LINEAR_ACTIVATIONS[activation](kernels.linear(x, packed, bias))
    assert (out - expected).abs().max() <= 1e-6 * (1 + expected.abs().max())
