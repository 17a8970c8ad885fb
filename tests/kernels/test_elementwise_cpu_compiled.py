"""The compiled element-wise ops of a Llama layer and the compiled K/V store
(kernels/cpu/csrc/rope.h, activation.h, kv_store.h) against their references
on fresh random inputs, and the kernels functions' choice of path."""

import pytest
import torch

import kernels
from kernels.cpu import ops as cpu_ops
from kernels.reference import rope_reference, silu_and_mul_reference, store_kvcache_reference

DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module")
def ops(compiled_cpu_ops):
    return compiled_cpu_ops


def _qkv(seed, tokens, heads, kv_heads, head_dim, dtype):
    """A fused qkv output; q and k are [tokens, heads, head_dim] slices of it."""
    generator = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * head_dim
    return (torch.randn(tokens, width, generator=generator) * 2).to(dtype)


def _tables(seed, tokens, head_dim, dtype):
    """cos / sin rows as RotaryEmbedding.tables gives them, at random positions."""
    generator = torch.Generator().manual_seed(seed + 1)
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 4000
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


# (tokens, heads rotated together, kv_heads, head_dim): SmolLM2's 9 + 3 heads of 64,
# head dims off the vector width (tails), one token, and rows that span threads.
ROPE_SHAPES = ((1, 9, 3, 64), (5, 4, 2, 128), (3, 2, 1, 48), (70, 9, 3, 64), (2, 1, 1, 6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=str)
def test_rope_is_torch_bit_for_bit(ops, shape, dtype, session_seed):
    tokens, heads, kv_heads, head_dim = shape
    qkv = _qkv(session_seed, tokens, heads, kv_heads, head_dim, dtype)
    cos, sin = _tables(session_seed, tokens, head_dim, dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    expected = rope_reference(qk, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    ops.rotary_embedding(qk, cos, sin)
    assert torch.equal(qk, expected), f"seed {session_seed}"
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


def test_rope_through_kernels_rotates_in_place(ops, session_seed):
    qkv = _qkv(session_seed, 6, 9, 3, 64, torch.bfloat16)
    cos, sin = _tables(session_seed, 6, 64, torch.bfloat16)
    qk = qkv[:, : 12 * 64].view(6, 12, 64)
    expected = rope_reference(qk, cos, sin)
    assert kernels.rope(qk, cos, sin) is qk
    assert torch.equal(qk, expected)
    # A layout the op does not take goes to the reference, which returns a new tensor.
    strided = expected.transpose(1, 2).contiguous().transpose(1, 2)  # head_dim not packed
    out = kernels.rope(strided, cos, sin)
    assert out is not strided and torch.equal(out, rope_reference(strided, cos, sin))


# (tokens, width): SmolLM2's 1536, a width off the vector (tails), rows that span threads.
SILU_SHAPES = ((1, 1536), (4, 40), (3, 7), (50, 1536))


def _gate_up(seed, tokens, width, dtype):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 2 * width, generator=generator) * 4
    x[0, : min(width, 6)] = torch.tensor([0.0, -0.0, 30.0, -30.0, 100.0, -100.0])[: min(width, 6)]
    return x.to(dtype)


def bf16_step(values: torch.Tensor) -> torch.Tensor:
    """The distance from each value to the next bf16 of larger magnitude (8 significant bits)."""
    return 2.0 ** (torch.frexp(values.double())[1] - 8)


@pytest.mark.parametrize("shape", SILU_SHAPES, ids=str)
def test_silu_and_mul_bfloat16_matches_torch(ops, shape, session_seed):
    x = _gate_up(session_seed, *shape, torch.bfloat16)
    out = ops.silu_and_mul(x)
    expected = silu_and_mul_reference(x)
    assert out.shape == expected.shape and out.dtype == torch.bfloat16
    # Both round silu(gate) to bf16, then the product: only an exp that lands on
    # the other side of a rounding boundary moves silu by one bf16 step, and the
    # product then by |up| times that step (plus its own rounding).
    gate, up = x.double().chunk(2, dim=-1)
    silu = gate * torch.sigmoid(gate)
    bound = bf16_step(expected) + up.abs() * bf16_step(silu)
    assert ((out.double() - expected.double()).abs() <= bound).all(), f"seed {session_seed}"
    assert (out == expected).float().mean() > 0.99


@pytest.mark.parametrize("shape", SILU_SHAPES, ids=str)
def test_silu_and_mul_float32_matches_to_rounding(ops, shape, session_seed):
    x = _gate_up(session_seed, *shape, torch.float32)
    torch.testing.assert_close(ops.silu_and_mul(x), silu_and_mul_reference(x), rtol=2e-6, atol=1e-6)


def test_silu_and_mul_special_values(ops):
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0] * 8 + [1.0] * 32], dtype=torch.bfloat16)
    out, expected = ops.silu_and_mul(x), silu_and_mul_reference(x)
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out[~out.isnan()], expected[~expected.isnan()])


def test_kernels_silu_and_mul_takes_the_op_for_bfloat16_only(ops, session_seed):
    x = _gate_up(session_seed, 3, 64, torch.float32)
    assert torch.equal(kernels.silu_and_mul(x), silu_and_mul_reference(x))  # float32: torch's ops
    bf16 = x.bfloat16()
    assert torch.equal(kernels.silu_and_mul(bf16), ops.silu_and_mul(bf16))


def _cache(seed, blocks, block_size, kv_heads, head_dim, dtype):
    generator = torch.Generator().manual_seed(seed + 2)
    shape = (blocks, block_size, kv_heads, head_dim)
    return [torch.randn(shape, generator=generator).to(dtype) for _ in range(2)]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
def test_store_kvcache_writes_what_the_reference_writes(ops, dtype, session_seed):
    tokens, heads, kv_heads, head_dim = 9, 6, 2, 32
    qkv = _qkv(session_seed, tokens, heads, kv_heads, head_dim, dtype)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    k_cache, v_cache = _cache(session_seed, 5, 4, kv_heads, head_dim, dtype)
    generator = torch.Generator().manual_seed(session_seed)
    slots = torch.randperm(20, generator=generator)[:tokens]
    slots[[2, 7]] = -1  # skipped tokens
    expected = [c.clone() for c in (k_cache, v_cache)]
    store_kvcache_reference(k, v, *expected, slots)
    ops.store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])


def test_store_kvcache_refuses_a_slot_outside_the_cache_before_writing(ops):
    k_cache, v_cache = _cache(0, 2, 4, 1, 32, torch.bfloat16)
    before = k_cache.clone()
    rows = torch.ones(2, 1, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="slot 8 of token 1 is outside"):
        ops.store_kvcache(rows, rows, k_cache, v_cache, torch.tensor([0, 8]))
    assert torch.equal(k_cache, before)


def test_kernels_store_kvcache_converts_through_the_reference(ops):
    """float32 rows into a bf16 cache, and int32 slots: the reference path, same result."""
    k_cache, v_cache = _cache(0, 2, 4, 1, 32, torch.bfloat16)
    rows = torch.randn(3, 1, 32)
    slots = torch.tensor([5, -1, 0], dtype=torch.int32)
    expected = [c.clone() for c in (k_cache, v_cache)]
    store_kvcache_reference(rows, rows, *expected, slots)
    kernels.store_kvcache(rows, rows, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])


@pytest.mark.parametrize("call, message", [
    (lambda o, t: o.rotary_embedding(t.transpose(0, 1), t[:, 0], t[:, 0]), "heads and head_dim packed"),
    (lambda o, t: o.rotary_embedding(t, t[:, 0, :-2], t[:, 0, :-2]), "cos and sin must be"),
    (lambda o, t: o.rotary_embedding(t.half(), t[:, 0].half(), t[:, 0].half()), "float32 or bf16"),
    (lambda o, t: o.silu_and_mul(t[:, 0, :-1].contiguous()), "2 \\* width"),
    (lambda o, t: o.store_kvcache(t, t, t, t, torch.zeros(4, dtype=torch.long)), "cache must be"),
    (lambda o, t: o.store_kvcache(t, t, t[None], t[None], torch.zeros(4, dtype=torch.int32)), "int64"),
])
def test_bad_inputs_are_refused(ops, call, message):
    tensor = torch.zeros(4, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        call(ops, tensor)


def test_without_compiled_ops_the_functions_are_the_references(monkeypatch):
    monkeypatch.setenv(cpu_ops.ENV_VAR, "off")
    qk = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    cos, sin = _tables(0, 2, 8, torch.bfloat16)
    out = kernels.rope(qk, cos, sin)
    assert out is not qk and torch.equal(out, rope_reference(qk, cos, sin))
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    assert torch.equal(kernels.silu_and_mul(x), silu_and_mul_reference(x))
