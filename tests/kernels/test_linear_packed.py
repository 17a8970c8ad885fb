"""The packed bf16 linear (kernels/cpu/csrc/linear_packed.h: weights laid out
for AVX512-BF16's dot product, read with fp32 FMAs on AVX2) against float64
matmuls on fresh random inputs, and the layout's helpers: kernels.pack_linear / unpack_linear /
embedding and linear's dispatch on a packed weight.

Shapes cross the op's blocking: token counts around its 8-token (AVX2: 5)
panels and its chunks (280 tokens of 576 inputs, 104 of 1536), output blocks around its
3-block tiles and 6-block strips; where the CPU has AMX (kernels/cpu/csrc/amx.h,
every call), around its 32- and 16-token panels, its padded last tile, its
2-block tiles and its chunks (160 tokens of 1536 inputs).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.cpu import ops as cpu_ops

TOKENS = (1, 2, 5, 7, 8, 9, 17, 48, 131, 300)
FEATURES = ((32, 16), (64, 48), (576, 112), (1536, 592))  # (in, out)


@pytest.fixture(scope="module")
def ops(compiled_cpu_ops):
    if not hasattr(compiled_cpu_ops, "linear_bf16_packed"):
        pytest.skip(f"the {compiled_cpu_ops.isa()} build has no packed linear (needs AVX-512 or AVX2)")
    return compiled_cpu_ops


def _inputs(generator, tokens, in_features, out_features):
    x = torch.randn(tokens, in_features, generator=generator).bfloat16()
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator)
    return x, weight, bias


def _sum_scale(x, weight, bias):
    """What an fp32 sum's rounding error grows with: the sum of |terms|."""
    return F.linear(x.double().abs(), weight.double().abs()) + bias.double().abs() + 1


@pytest.mark.parametrize("features", FEATURES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_float_out_matches_float64(ops, tokens, features, session_seed):
    generator = torch.Generator().manual_seed(session_seed + tokens)
    x, weight, bias = _inputs(generator, tokens, *features)
    out = ops.linear_bf16_packed(x, kernels.pack_linear(weight), bias, True)
    assert out.dtype == torch.float32 and out.shape == (tokens, features[1])
    expected = F.linear(x.double(), weight.double(), bias.double())
    error = (out.double() - expected).abs() / _sum_scale(x, weight, bias)
    assert error.max() < 1e-6, f"seed {session_seed}: relative error {error.max():.2e}"


@pytest.mark.parametrize("tokens", (1, 9, 131))
def test_bf16_out_is_the_float_sum_rounded_once(ops, tokens, session_seed):
    generator = torch.Generator().manual_seed(session_seed + 3 * tokens)
    x, weight, bias = _inputs(generator, tokens, 576, 112)
    packed = kernels.pack_linear(weight)
    wide = ops.linear_bf16_packed(x, packed, bias, True)
    assert torch.equal(ops.linear_bf16_packed(x, packed, bias), wide.to(torch.bfloat16))
    no_bias = ops.linear_bf16_packed(x, packed, None, True)
    assert torch.equal(no_bias + bias, wide)


def test_a_token_gets_the_same_numbers_in_any_batch(ops, session_seed):
    """Every (token, feature) sum walks the input pairs in order in one lane,
    whatever panel, tile or chunk it lands in."""
    generator = torch.Generator().manual_seed(session_seed)
    x, weight, bias = _inputs(generator, 300, 576, 112)
    packed = kernels.pack_linear(weight)
    whole = ops.linear_bf16_packed(x, packed, bias)
    for row in (0, 7, 8, 131, 279, 280, 299):
        assert torch.equal(ops.linear_bf16_packed(x[row:row + 1], packed, bias)[0], whole[row])


def test_rows_never_mix(ops, session_seed):
    generator = torch.Generator().manual_seed(session_seed)
    x, weight, bias = _inputs(generator, 9, 64, 48)
    x[5, 17] = float("nan")
    out = ops.linear_bf16_packed(x, kernels.pack_linear(weight), bias)
    assert out[5].isnan().all() and not out[[0, 1, 2, 3, 4, 6, 7, 8]].isnan().any()


@pytest.mark.parametrize("x, message", [
    (torch.ones(2, 64), "x must be bf16"),
    (torch.ones(2, 32, dtype=torch.bfloat16), "x must be bf16 \\[tokens, 64\\]"),
])
def test_bad_inputs_are_refused(ops, x, message):
    packed = kernels.pack_linear(torch.ones(16, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=message):
        ops.linear_bf16_packed(x, packed, None)
    with pytest.raises(RuntimeError, match="packed by kernels.pack_linear"):
        ops.linear_bf16_packed(x, torch.ones(16, 64, dtype=torch.bfloat16), None)


def _gelu_bound(pre):
    """How far the epilogue's GELU of ``pre`` may sit from the exact one: one
    bf16 rounding of the result (2^-8 of it, to be safe from the half step)
    plus what the erf formula adds (|error| <= 1.5e-7, times |x| / 2, and
    float arithmetic's share)."""
    return F.gelu(pre.double()).abs() * 2**-8 + pre.double().abs() * 1e-7 + 1e-30


@pytest.mark.parametrize("features", ((576, 112), (1536, 592)), ids=str)
@pytest.mark.parametrize("tokens", (1, 9, 131))
def test_gelu_and_relu_in_the_epilogue(ops, tokens, features, session_seed):
    """The activation of the stored product (rounded to bf16, as torch stores
    it before F.gelu reads it): GELU within its bound of the exact GELU of
    that number, ReLU exactly torch's."""
    generator = torch.Generator().manual_seed(session_seed + 5 * tokens)
    x, weight, bias = _inputs(generator, tokens, *features)
    x = (x.float() / features[0] ** 0.5).bfloat16()  # products of a few units: GELU's curved part
    packed = kernels.pack_linear(weight)
    for float_out in (False, True):
        plain = ops.linear_bf16_packed(x, packed, bias, float_out)
        out = ops.linear_bf16_packed(x, packed, bias, float_out, "gelu")
        assert out.dtype == plain.dtype
        error = (out.double() - F.gelu(plain.double())).abs()
        assert (error <= _gelu_bound(plain)).all(), f"seed {session_seed}: {error.max():.2e}"
        assert torch.equal(ops.linear_bf16_packed(x, packed, bias, float_out, "relu"), F.relu(plain))
    # Against torch's bf16 GELU, the reference's (kernels.reference.linear_reference):
    # one step of bf16 where the formulas round apart, and the absolute slack of
    # torch's 1 + erf near -1, which loses a negative input's small outputs.
    plain = ops.linear_bf16_packed(x, packed, bias)
    torch_gelu = F.gelu(plain).double()
    error = (ops.linear_bf16_packed(x, packed, bias, False, "gelu").double() - torch_gelu).abs()
    assert (error <= torch_gelu.abs() * 2**-7 + 2e-6).all()


def test_an_unknown_activation_is_refused(ops):
    packed = kernels.pack_linear(torch.ones(16, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="activation must be none, gelu or relu, got silu"):
        ops.linear_bf16_packed(torch.ones(2, 64, dtype=torch.bfloat16), packed, None, False, "silu")


def test_the_layout_round_trips_and_embeds(ops, session_seed):
    generator = torch.Generator().manual_seed(session_seed)
    weight = torch.randn(48, 64, generator=generator).bfloat16()
    packed = kernels.pack_linear(weight)
    assert packed.shape == (3, 32, 16, 2)
    # W[n][2p + j] sits at packed[n // 16][p][n % 16][j]
    assert packed[2, 5, 7, 1] == weight[2 * 16 + 7, 2 * 5 + 1]
    assert torch.equal(kernels.unpack_linear(packed), weight)
    ids = torch.randint(0, 48, (3, 5), generator=generator)
    assert torch.equal(kernels.embedding(ids, packed), F.embedding(ids, weight))
    assert torch.equal(kernels.embedding(ids, weight), F.embedding(ids, weight))


def test_only_bf16_weights_with_whole_blocks_are_packed(ops):
    for weight in (torch.ones(40, 64, dtype=torch.bfloat16),  # 40 is no multiple of 16
                   torch.ones(48, 64),                        # float32: F.linear's
                   torch.ones(48, 24, dtype=torch.bfloat16)):  # no build takes 24 inputs
        assert kernels.pack_linear(weight) is weight
    assert kernels.get_backend("torch").pack_linear(torch.ones(48, 64).bfloat16()).dim() == 2


def test_kernels_linear_multiplies_packed_weights(ops, monkeypatch, session_seed):
    generator = torch.Generator().manual_seed(session_seed)
    x, weight, bias = _inputs(generator, 6, 64, 48)
    packed = kernels.pack_linear(weight)
    assert torch.equal(kernels.linear(x, packed, bias), ops.linear_bf16_packed(x, packed, bias))
    assert torch.equal(kernels.linear(x.view(2, 3, 64), packed, bias),
                       ops.linear_bf16_packed(x, packed, bias).view(2, 3, 48))
    assert torch.equal(kernels.linear(x, packed, bias, float_out=True),
                       ops.linear_bf16_packed(x, packed, bias, True))
    # GELU and ReLU in the op's epilogue; an activation it has not, after it.
    for activation in ("gelu", "relu"):
        assert torch.equal(kernels.linear(x, packed, bias, activation=activation),
                           ops.linear_bf16_packed(x, packed, bias, False, activation))
    assert torch.equal(kernels.linear(x, packed, bias, activation="gelu_pytorch_tanh"),
                       F.gelu(ops.linear_bf16_packed(x, packed, bias), approximate="tanh"))
    # Turned off after packing: the reference over the unpacked weight.
    monkeypatch.setenv(cpu_ops.ENV_VAR, "off")
    b16 = bias.bfloat16()
    assert torch.equal(kernels.linear(x, packed, b16), F.linear(x, weight, b16))
    assert torch.equal(kernels.linear(x, packed, b16, activation="gelu"), F.gelu(F.linear(x, weight, b16)))


def _cpu_has_amx() -> bool:
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    return "amx_tile" in flags and "amx_bf16" in flags


_AMX_OFF_RUN = """
import sys, torch, kernels
from kernels.cpu import ops as cpu_ops
ops = cpu_ops.ops_for(64)
x, weight = torch.load(sys.argv[1])
torch.save((ops.amx(), ops.linear_bf16_packed(x, kernels.pack_linear(weight), None, True)), sys.argv[2])
"""


def test_amx_takes_the_calls_where_the_cpu_has_it(ops, tmp_path, session_seed):
    """AMX's tiles serve the AVX512-BF16 build where the CPU has AMX (Linux lets
    this process use its tile data), and PAGEDSERVE_CPU_AMX=off keeps the
    AVX-512 tiles: both within the same bound of float64."""
    expected = ops.isa() == "avx512bf16" and _cpu_has_amx() and os.environ.get("PAGEDSERVE_CPU_AMX") != "off"
    assert ops.amx() == expected
    generator = torch.Generator().manual_seed(session_seed)
    x, weight, _ = _inputs(generator, 40, 576, 112)
    torch.save((x, weight), tmp_path / "in.pt")
    env = {**os.environ, "PAGEDSERVE_CPU_AMX": "off", "PAGEDSERVE_CPU_KERNELS": ops.isa()}
    subprocess.run([sys.executable, "-c", _AMX_OFF_RUN, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                   env=env, check=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    amx_off, out_off = torch.load(tmp_path / "out.pt")
    assert amx_off is False
    on = ops.linear_bf16_packed(x, kernels.pack_linear(weight), None, True)
    reference = F.linear(x.double(), weight.double())
    scale = F.linear(x.double().abs(), weight.double().abs()) + 1
    for out in (on, out_off):
        assert ((out.double() - reference).abs() / scale).max() < 1e-6
