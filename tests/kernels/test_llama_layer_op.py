"""The compiled layer op (kernels/cpu/csrc/llama_layer.h) against the same
compiled ops called one by one, on fresh random bf16 inputs: the same numbers
to the bit, the same K/V written into the cache, and its own input checks
(it rotates and stores q, k and v through pointers into qkv's rows, so the
checks rotary_embedding and store_kvcache would make are its own).

The engine-level tests (tests/engine/test_fused_layer.py) hold it against
the Python layer on real models; these hold the op itself, decode and
prefill rows, with and without a residual.
"""

import pytest
import torch

from kernels.kv_quant import quantize_rows, to_fp8

# A head_dim of 32: the AVX512 builds take multiples of 32, AVX2's of 16.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 64, 4, 2, 32, 96
BLOCKS, BLOCK_SIZE, EPS = 6, 16, 1e-5
SCALE = HEAD_DIM ** -0.5


@pytest.fixture(scope="module")
def ops(compiled_cpu_ops):
    if not hasattr(compiled_cpu_ops, "llama_layer"):
        pytest.skip(f"the {compiled_cpu_ops.isa()} build has no layer op")
    return compiled_cpu_ops


def _weights(g, qk_norm: bool = False):
    """A layer's weights; with `qk_norm`, Qwen3's norms of each q and k head."""
    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.2).bfloat16()
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    weights = dict(input_norm=1 + w(HIDDEN), qkv=w(qkv, HIDDEN), qkv_bias=w(qkv), o=w(HIDDEN, HEADS * HEAD_DIM),
                   post_norm=1 + w(HIDDEN), gate_up=w(2 * INTERMEDIATE, HIDDEN), down=w(HIDDEN, INTERMEDIATE))
    if qk_norm:
        weights.update(q_norm=1 + w(HEAD_DIM), k_norm=1 + w(HEAD_DIM))
    return weights


def _step(g, lens, decode):
    """A step's rows: `decode` sequences decoding one token each, then one
    prefill span per remaining length (its last `new` tokens are new)."""
    tables = torch.randperm(BLOCKS, generator=g).int().view(-1, 2)[: len(lens)].contiguous()
    new = [1] * decode + [3] * (len(lens) - decode)
    slots = [int(tables[s, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
             for s, length in enumerate(lens) for p in range(length - new[s], length)]
    positions = [p for s, length in enumerate(lens) for p in range(length - new[s], length)]
    cu = torch.tensor([0] + list(torch.tensor(new[decode:]).cumsum(0)), dtype=torch.int32)
    return dict(slots=torch.tensor(slots), positions=torch.tensor(positions), tables=tables,
                lens=torch.tensor(lens, dtype=torch.int32), decode=decode, cu=cu)


def _rope(positions):
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles = positions.float()[:, None] * inv[None, :]
    angles = torch.cat([angles, angles], dim=1)
    return angles.cos().bfloat16(), angles.sin().bfloat16()


def _layer_args(w, step, cos, sin, caches):
    d = step["decode"]
    return (w["input_norm"], w["qkv"], w["qkv_bias"], w["o"], None, w["post_norm"], w["gate_up"], None,
            w["down"], None, w.get("q_norm"), w.get("k_norm"), cos, sin, caches[0], caches[1], step["slots"], d,
            step["tables"][:d],
            step["lens"][:d], step["tables"][d:], step["cu"], step["lens"][d:], HEADS, KV_HEADS, EPS, SCALE)


def _one_by_one(ops, hidden, residual, w, step, cos, sin, caches):
    """The layer as the Python path runs it: each compiled op in turn."""
    tokens, q_size, kv_size = hidden.shape[0], HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    stream = hidden.clone() if residual is None else residual
    x = ops.rms_norm(hidden, w["input_norm"], EPS, None if residual is None else stream)
    qkv = ops.linear_bf16(x, w["qkv"], w["qkv_bias"])
    qk = qkv[:, : q_size + kv_size].view(tokens, HEADS + KV_HEADS, HEAD_DIM)
    if "q_norm" in w:  # as Attention._norm_heads: each head a row of the norm op, then one tensor
        q, k = qk.split([HEADS, KV_HEADS], dim=1)
        qk = torch.cat((ops.rms_norm(q.reshape(-1, HEAD_DIM), w["q_norm"], EPS, None).view(q.shape),
                        ops.rms_norm(k.reshape(-1, HEAD_DIM), w["k_norm"], EPS, None).view(k.shape)), dim=1)
    ops.rotary_embedding(qk, cos, sin)
    q = qk[:, :HEADS].contiguous()
    ops.store_kvcache(qk[:, HEADS:], qkv[:, q_size + kv_size:].view(tokens, KV_HEADS, HEAD_DIM),
                      caches[0], caches[1], step["slots"])
    d = step["decode"]
    attn = torch.cat([
        ops.paged_decode_attention(q[:d], *caches, step["tables"][:d], step["lens"][:d], SCALE),
        ops.paged_prefill_attention(q[d:], *caches, step["tables"][d:], step["cu"], step["lens"][d:], SCALE),
    ])
    o = ops.linear_bf16(attn.reshape(tokens, q_size), w["o"], None)
    x = ops.rms_norm(o, w["post_norm"], EPS, stream)
    return ops.linear_bf16(ops.silu_and_mul(ops.linear_bf16(x, w["gate_up"], None)), w["down"], None), stream


def _caches(g, cache_dtype: str = "bf16"):
    """bf16 caches, or int8 / fp8 ones (kernels/kv_quant.py) holding random rows."""
    shape = (BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = [torch.randn(*shape, generator=g).bfloat16() for _ in range(2)]
    if cache_dtype == "int8":
        return [quantize_rows(c) for c in caches]
    return [to_fp8(c, torch.float8_e4m3fn) for c in caches] if cache_dtype == "fp8" else caches


@pytest.mark.parametrize("cache_dtype", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-norms"])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("lens,decode", [([7], 1), ([20, 9], 2), ([5, 18, 30], 1), ([12], 0)])
def test_layer_op_is_the_ops_one_by_one(ops, session_seed, lens, decode, with_residual, qk_norm, cache_dtype):
    """int8 / fp8 caches: the op quantizes k and v as store_kvcache does, and attends them in place."""
    g = torch.Generator().manual_seed(session_seed)
    w, step, caches = _weights(g, qk_norm), _step(g, lens, decode), _caches(g, cache_dtype)
    tokens = len(step["slots"])
    hidden = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
    residual = torch.randn(tokens, HIDDEN, generator=g).bfloat16() if with_residual else None
    cos, sin = _rope(step["positions"])
    theirs_caches = [c.clone() for c in caches]
    expected, expected_stream = _one_by_one(ops, hidden.clone(), None if residual is None else residual.clone(),
                                            w, step, cos, sin, theirs_caches)
    stream_in = None if residual is None else residual.clone()
    hidden_in = hidden.clone()
    out, stream = ops.llama_layer(hidden_in, stream_in, *_layer_args(w, step, cos, sin, caches))
    assert torch.equal(out, expected)
    assert torch.equal(stream, expected_stream)
    assert torch.equal(caches[0], theirs_caches[0]) and torch.equal(caches[1], theirs_caches[1])


def test_layer_op_checks_what_it_writes_through_pointers(ops, session_seed):
    g = torch.Generator().manual_seed(session_seed)
    w, step, caches = _weights(g), _step(g, [20, 9], 2), _caches(g)
    hidden = torch.randn(2, HIDDEN, generator=g).bfloat16()
    cos, sin = _rope(step["positions"])
    before = [c.clone() for c in caches]

    outside = dict(step, slots=torch.tensor([0, BLOCKS * BLOCK_SIZE]))
    with pytest.raises(RuntimeError, match="slot 96 of token 1 is outside the cache's 96 slots"):
        ops.llama_layer(hidden, None, *_layer_args(w, outside, cos, sin, caches))
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])  # nothing written

    with pytest.raises(RuntimeError, match="cos and sin must be contiguous bf16"):
        ops.llama_layer(hidden, None, *_layer_args(w, step, cos[:1], sin[:1], caches))
    strided = torch.zeros(BLOCKS, BLOCK_SIZE, KV_HEADS, 2 * HEAD_DIM).bfloat16()[..., :HEAD_DIM]
    with pytest.raises(RuntimeError, match="caches must be contiguous bf16"):
        ops.llama_layer(hidden, None, *_layer_args(w, step, cos, sin, [caches[0], strided]))
    with pytest.raises(RuntimeError, match="slot_mapping must be a contiguous int64"):
        ops.llama_layer(hidden, None, *_layer_args(w, dict(step, slots=step["slots"].int()), cos, sin, caches))


def _stack_weights(ws):
    """Twelve weights a layer, in llama_layer's order."""
    return [t for w in ws for t in (w["input_norm"], w["qkv"], w["qkv_bias"], w["o"], None, w["post_norm"],
                                    w["gate_up"], None, w["down"], None, w.get("q_norm"), w.get("k_norm"))]


def _stack_args(ops, ws, step, cos, sin, caches, final_norm=None):
    """llama_layers' arguments after the hidden states: the stack's unchanging
    ones in one object (its twelve weights a layer, a K and a V cache a layer,
    the final norm), then the step's."""
    import kernels

    d = step["decode"]
    held = kernels.llama_stack_args(ops.llama_layers.default, _stack_weights(ws), [c[0] for c in caches],
                                    [c[1] for c in caches], final_norm, 12)
    return (held, cos, sin, step["slots"], d, step["tables"][:d], step["lens"][:d], step["tables"][d:],
            step["cu"], step["lens"][d:], HEADS, KV_HEADS, EPS, SCALE)


def _assert_stack_is_layer_by_layer(ops, ws, step, cos, sin, caches, hidden, final_norm=None):
    """The stack op's outputs and caches equal the layer op's called for each
    layer in turn (the first without a residual) on copies of the caches,
    then, with `final_norm`, the norm op over the last output and the stream."""
    theirs = [[c.clone() for c in pair] for pair in caches]
    expected, stream = hidden.clone(), None
    for w, pair in zip(ws, theirs):
        expected, stream = ops.llama_layer(expected, stream, *_layer_args(w, step, cos, sin, pair))
    if final_norm is not None:
        expected = ops.rms_norm(expected, final_norm, EPS, stream)
    out, out_stream = ops.llama_layers(hidden.clone(), *_stack_args(ops, ws, step, cos, sin, caches, final_norm))
    assert torch.equal(out, expected) and torch.equal(out_stream, stream)
    for mine, their in zip(caches, theirs):
        assert torch.equal(mine[0], their[0]) and torch.equal(mine[1], their[1])


@pytest.mark.parametrize("quantized,qk_norm", [(False, False), (True, False), (True, True), ("packed", False)])
@pytest.mark.parametrize("lens,decode", [([7], 1), ([9, 30, 3], 3), ([5, 18, 30], 1), ([12], 0)])
def test_stack_op_is_the_layer_op_layer_by_layer(ops, session_seed, lens, decode, quantized, qk_norm):
    """Three layers with their own weights and caches: the stack op against
    the layer op called for each in turn (the first without a residual);
    bf16 weights, or blobs (_quantized), or blobs in the layout this build
    multiplies (kernels.pack_linear: 16-row panels on the VNNI build); with
    or without per-head norms; with the model's final norm in the op (after
    quantized layers, whose decode steps run in one region) or without.  A
    step of decode rows alone over quantized weights runs its layers in one
    region (kernels/cpu/csrc/team.h); the layer op never does, so the two
    must agree to the bit."""
    g = torch.Generator().manual_seed(session_seed)
    step = _step(g, lens, decode)
    ws, caches = [_weights(g, qk_norm) for _ in range(3)], [_caches(g) for _ in range(3)]
    if quantized:
        ws = [_quantized(g, w) for w in ws]
    if quantized == "packed":
        import kernels

        ws = [dict(w, **{k: kernels.pack_linear(w[k]) for k in ("qkv", "o", "gate_up", "down")}) for w in ws]
    hidden = torch.randn(len(step["slots"]), HIDDEN, generator=g).bfloat16()
    cos, sin = _rope(step["positions"])
    final_norm = (1 + torch.randn(HIDDEN, generator=g) * 0.2).bfloat16() if quantized else None
    _assert_stack_is_layer_by_layer(ops, ws, step, cos, sin, caches, hidden, final_norm)


def test_stack_op_raises_from_its_region_and_serves_after(ops, session_seed):
    """A decode step over quantized weights runs its layers in one region
    (kernels/cpu/csrc/team.h): an error inside it (a slot past the cache, in
    the second layer) comes out as the layer op's error, the threads left
    the region, and the next call gives the layer op's numbers."""
    g = torch.Generator().manual_seed(session_seed)
    step = _step(g, [9, 30, 3], 3)
    ws, caches = [_quantized(g, _weights(g)) for _ in range(2)], [_caches(g) for _ in range(2)]
    hidden = torch.randn(3, HIDDEN, generator=g).bfloat16()
    cos, sin = _rope(step["positions"])
    small = torch.zeros(1, BLOCK_SIZE, KV_HEADS, HEAD_DIM).bfloat16()  # layer 1's caches: 16 slots
    bad = _stack_args(ops, ws, step, cos, sin, [caches[0], [small, small.clone()]])
    with pytest.raises(RuntimeError, match="is outside the cache's 16 slots"):
        ops.llama_layers(hidden.clone(), *bad)
    _assert_stack_is_layer_by_layer(ops, ws, step, cos, sin, caches, hidden)


def test_stack_op_checks_its_arguments(ops, session_seed):
    import kernels

    g = torch.Generator().manual_seed(session_seed)
    step = _step(g, [7], 1)
    ws, caches = [_weights(g) for _ in range(2)], [_caches(g) for _ in range(2)]
    hidden = torch.randn(1, HIDDEN, generator=g).bfloat16()
    cos, sin = _rope(step["positions"])
    op, weights = ops.llama_layers.default, _stack_weights(ws)
    keys, values = [c[0] for c in caches], [c[1] for c in caches]
    with pytest.raises(ValueError, match="2 K caches, 1 V caches and 24 weights"):
        kernels.llama_stack_args(op, weights, keys, values[:1], None, 12)
    with pytest.raises(ValueError, match="2 K caches, 2 V caches and 23 weights"):
        kernels.llama_stack_args(op, weights[:23], keys, values, None, 12)
    with pytest.raises(ValueError, match="12 weights a layer, or 20"):
        kernels.llama_stack_args(op, weights, keys, values, None, 6)
    weights[12 + 3] = None  # the second layer's o_proj
    with pytest.raises(ValueError, match="layer 1 weight 3 is None"):
        kernels.llama_stack_args(op, weights, keys, values, None, 12)
    args = _stack_args(ops, ws, step, cos, sin, caches)
    with pytest.raises(ValueError, match="lora_ids go with LoRA stacks"):
        ops.llama_layers(hidden, *args, lora_ids=torch.zeros(1, dtype=torch.long))


def _quantized(g, w):
    """The layer's four linear weights as blobs of legacy types (every width
    here is a multiple of 32): q|k|v as three parts of three types, as a
    Q4_K_M file mixes them."""
    from kernels.quant import pack_quant_weight, quant_parts, quantize_weight

    q_rows, kv_rows = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = w["qkv"].float()
    pieces = [(qkv[:q_rows], "Q4_0"), (qkv[q_rows:q_rows + kv_rows], "Q5_1"), (qkv[q_rows + kv_rows:], "Q8_0")]
    parts = [quant_parts(quantize_weight(piece, name))[0] for piece, name in pieces]
    return dict(w, qkv=pack_quant_weight(parts, HIDDEN), o=quantize_weight(w["o"].float(), "Q4_1"),
                gate_up=quantize_weight(w["gate_up"].float(), "Q5_0"), down=quantize_weight(w["down"].float(), "Q8_0"))


def test_layer_op_takes_quantized_weights(ops, session_seed):
    """A layer whose linears are blobs: (1) the layer op is the ops one by one
    with quant_linear, to the bit (layer_parts::linear dispatches by dtype);
    (2) each of those products is within the activation-quantization bound
    of the exact de-quantized weights' float32 product (the bound of
    tests/kernels/test_quant_linear.py: sum_i |w_i| * amax(x's block of i) / 254,
    plus float32 and bf16 output rounding); (3) the whole layer stays close to
    the same layer run with the de-quantized weights through the reference
    linear (a loose end-to-end check: the bound does not compose through
    attention and the norms)."""
    from kernels.quant import quant_linear_reference
    from test_quant_linear import _bound

    g = torch.Generator().manual_seed(session_seed)
    w, step, caches = _weights(g), _step(g, [5, 18, 30], 1), _caches(g)
    wq = _quantized(g, w)
    hidden = torch.randn(len(step["slots"]), HIDDEN, generator=g).bfloat16()
    cos, sin = _rope(step["positions"])

    class Checked:  # the compiled ops, with linear_bf16 as quant_linear held to the bound
        def __getattr__(self, name):
            return getattr(ops, name)

        def linear_bf16(self, x, blob, bias):
            got = ops.quant_linear(x, blob, bias)
            expected = quant_linear_reference(x, blob, bias, float_out=True)
            bound = _bound(x, blob, torch.bfloat16, expected)
            assert bool(((got.float() - expected).abs() <= bound).all()), "a product outside the bound"
            return got

    theirs = [c.clone() for c in caches]
    expected, expected_stream = _one_by_one(Checked(), hidden.clone(), None, wq, step, cos, sin, theirs)
    out, stream = ops.llama_layer(hidden.clone(), None, *_layer_args(wq, step, cos, sin, caches))
    assert torch.equal(out, expected) and torch.equal(stream, expected_stream)
    assert torch.equal(caches[0], theirs[0]) and torch.equal(caches[1], theirs[1])

    class Dequantized(Checked):  # the same layer, the exact weights through the reference linear
        def linear_bf16(self, x, blob, bias):
            return quant_linear_reference(x, blob, bias)

    floats, _ = _one_by_one(Dequantized(), hidden.clone(), None, wq, step, cos, sin, [c.clone() for c in caches])
    scale = floats.float().abs().max().item()
    assert (out.float() - floats.float()).abs().max().item() <= 0.05 * scale
