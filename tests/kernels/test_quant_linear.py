"""The quantized linear (kernels/cpu/csrc/quant_linear.h, quant_blocks.h)
against gguf's own numbers and the reference product (kernels/quant.py), on
fresh random blocks each session, through every build this CPU runs.

* Exact: the op's de-quantized weights, read back through the blob, equal
  `gguf.quants.dequantize` bit for bit, for every type, including blocks
  with extreme scales (fp16 subnormals, ~3e4, negative, zero) and all-zero
  blocks.
* Bounded: the product quantizes each activation block of 32 to int8
  (x ~ d q, d = max|x| / 127, |x - d q| <= d / 2), and sums in float32. So
  per output  |y - y_ref| <= sum_i |w_i| d_block(i) / 2  (+ float32
  rounding of the sums, and the output's own rounding to bf16).  Where every
  part is a K-quant the int8 strips round a block of 256 (as llama.cpp's
  Q8_K): the bound of such a blob takes the 256-input block's d, never less
  than those of its eight blocks of 32.
"""

import pytest
import torch

import kernels
from kernels.quant import (QUANT_TYPES, can_panel, dequantize_reference, from_panels, has_panels, pack_quant_panels,
                           pack_quant_weight, quant_linear_reference, quant_parts, random_quant_blocks, to_panels)

TYPES = tuple(QUANT_TYPES)
# 1, 3, 6 and 42 end a row's passes with 1, 3, 2 and 2 tokens (quant_gemv.h);
# on AVX512-BF16 bf16 tokens take the int8 strips from 8 (quant_vnni.h, where
# AMX does not take the call; 42's 2 leftover tokens a tile of 2) and float32
# tokens from 32, so 16 takes the strips there for bf16 and the integer path
# for float32; AVX2 takes its int8 strips (quant_maddubs.h) from 8 tokens of
# either dtype, the integer path below; 128 is a prefill chunk.
ROWS = (1, 3, 6, 16, 42, 128)


def _width(type_name: str, blocks: int) -> int:
    return blocks * QUANT_TYPES[type_name].block_elems


def _blob(generator, type_names, out_features, in_features, zero_rows=0):
    parts = []
    for name in type_names:
        data = random_quant_blocks(name, out_features, in_features, generator)
        data[:zero_rows] = 0  # an all-zero block: every field 0
        parts.append((name, data))
    return pack_quant_weight(parts, in_features)


def _token_block(blob: torch.Tensor) -> int:
    """Inputs a token's scale covers at most: 256 where every part is a K-quant."""
    k_quants = all(QUANT_TYPES[name].block_elems == 256 for name, _ in quant_parts(blob))
    return 256 if k_quants else 32


def _bound(x: torch.Tensor, blob: torch.Tensor, out_dtype, expected: torch.Tensor) -> torch.Tensor:
    """The activation quantization's worst case per output, plus float32
    rounding, and for a bf16 output its rounding of `expected` (bias included)."""
    weight = dequantize_reference(blob)
    blocks = x.float().view(x.shape[0], -1, _token_block(blob))
    step = blocks.abs().amax(-1, keepdim=True) / 127  # d of each activation block
    half_step = (step / 2).expand_as(blocks).reshape(x.shape)
    magnitude = x.float().abs() @ weight.abs().t()
    bound = half_step @ weight.abs().t() * 1.001 + magnitude * 1e-5 + 1e-30
    if out_dtype == torch.bfloat16:
        bound = bound + (expected.abs() + bound) * 2.0**-8
    return bound


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_is_gguf_bit_for_bit(builds, type_name, session_seed):
    generator = torch.Generator().manual_seed(session_seed)
    blob = _blob(generator, [type_name], 37, _width(type_name, 3), zero_rows=2)
    expected = dequantize_reference(blob)
    for isa, ops in builds.items():
        got = ops.quant_dequantize(blob)
        assert got.view(torch.int32).equal(expected.view(torch.int32)), \
            f"{isa} {type_name}, seed {session_seed}: not gguf's bits"


def test_mixed_parts_come_back_in_order(builds, session_seed):
    generator = torch.Generator().manual_seed(session_seed)
    blob = _blob(generator, ["Q4_K", "Q6_K", "Q8_0", "Q5_K"], 5, 512)
    expected = dequantize_reference(blob)
    assert expected.shape == (20, 512)
    for ops in builds.values():
        assert ops.quant_dequantize(blob).view(torch.int32).equal(expected.view(torch.int32))


def test_chosen_rows_are_those_rows_of_the_whole(builds, session_seed):
    """rows= (an embedding lookup): the whole table's rows, in the order asked,
    repeats and every part included, in the op and in the reference."""
    generator = torch.Generator().manual_seed(session_seed)
    blob = _blob(generator, ["Q4_K", "Q6_K", "Q8_0", "Q4_1", "Q5_0"], 9, 512)
    whole = dequantize_reference(blob)
    rows = torch.randint(0, whole.shape[0], (23,), generator=generator)
    rows[:3] = torch.tensor([44, 0, 44])  # the last row, the first, a repeat
    expected = whole[rows]
    assert dequantize_reference(blob, rows).view(torch.int32).equal(expected.view(torch.int32))
    for isa, ops in builds.items():
        assert ops.quant_dequantize(blob, rows).view(torch.int32).equal(expected.view(torch.int32)), isa
        assert ops.quant_dequantize(blob, rows[:0]).shape == (0, 512)
        with pytest.raises(IndexError, match="45 rows"):
            ops.quant_dequantize(blob, torch.tensor([3, 45]))
    with pytest.raises(IndexError, match="45 rows"):
        dequantize_reference(blob, torch.tensor([-1]))


def _inputs(generator, type_names, rows, out_features, in_features, dtype):
    blob = _blob(generator, type_names, out_features, in_features)
    weight = dequantize_reference(blob)
    # Rescale so outputs stay finite at the extreme scales: a row times its inverse norm.
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features * len(type_names), generator=generator)
    return blob, weight, x, bias


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("type_name", TYPES)
def test_product_is_within_the_activation_bound(builds, type_name, rows, session_seed):
    generator = torch.Generator().manual_seed(session_seed + rows)
    # Widths for the one-token path's groups of 8 sub-blocks (quant_gemv.h):
    # a legacy row of 5 blocks is only a last, partial group; of 13 blocks,
    # a whole group and a partial one; K-quants are whole groups.
    legacy = QUANT_TYPES[type_name].block_elems == 32
    for dtype, blocks, out_features in ((torch.float32, 5 if legacy else 2, 37),
                                        (torch.bfloat16, 13 if legacy else 3, 101)):
        in_features = _width(type_name, blocks)
        blob, _, x, bias = _inputs(generator, [type_name], rows, out_features, in_features, dtype)
        expected = quant_linear_reference(x, blob, bias, float_out=True)
        bound = _bound(x, blob, dtype, expected)
        for isa, ops in builds.items():
            got = ops.quant_linear(x, blob, bias)
            assert got.dtype == dtype and got.shape == (rows, out_features)
            error = (got.float() - expected).abs()
            worst = (error / bound).max().item()
            assert worst <= 1, f"{isa} {type_name} {dtype} rows={rows} seed {session_seed}: {worst:.2f}x the bound"


@pytest.mark.parametrize("type_name", TYPES)
def test_one_token_against_long_rows(builds, type_name, session_seed):
    """Rows of 1.7-4.4 KB (Llama-1B's widths and past them) go four at a time
    at one token on both AVX builds, the next four asked for while these
    are read (quant_gemv.h's rows_dot, quant_lanes.h's lanes_rows_dot); a
    legacy row of 125 blocks ends on a partial group, and 37 rows leave one
    row after nine panels."""
    generator = torch.Generator().manual_seed(session_seed + 11)
    legacy = QUANT_TYPES[type_name].block_elems == 32
    in_features = _width(type_name, 125 if legacy else 12)
    _within_the_bound(builds, generator, [type_name], 1, 37, in_features, f"{type_name} seed {session_seed}")


@pytest.mark.parametrize("type_name", [name for name in TYPES if QUANT_TYPES[name].block_elems == 32])
def test_one_token_rows_ending_on_a_short_group_of_every_length(builds, type_name, session_seed):
    """A legacy row of 8 k + 1 .. 8 k + 7 blocks ends on a short group, which
    the AVX512 build's four-row panels run with its length as a constant
    (quant_lanes.h's lanes_rows_dot) and which reads the blocks' scales with
    masked loads that stop at its last block; 9 rows leave one row after two
    panels."""
    generator = torch.Generator().manual_seed(session_seed + 13)
    for short in range(1, 8):
        _within_the_bound(builds, generator, [type_name], 1, 9, _width(type_name, 16 + short),
                          f"{type_name} {16 + short} blocks seed {session_seed}")


@pytest.mark.parametrize("rows", (11, 13, 16, 42, 150))
@pytest.mark.parametrize("type_name", TYPES)
def test_bf16_tokens_against_whole_blocks_of_rows(builds, type_name, rows, session_seed):
    """Parts of whole 16-row blocks (a layer's usual shape): where the CPU has
    AMX, from 16 bf16 tokens the strips are de-quantized row by row and read as
    AMX's A operand (kernels/cpu/csrc/amx_rows.h), past 128 into the packed
    layout for amx.h's tiles; two parts (3 blocks each: a 2-block tile and one)
    and a bias land in their columns. 11 and 13 tokens take the int8 strips
    (quant_strip_run.h) and end on a tile of 3 and of 1 after tiles of 4."""
    generator = torch.Generator().manual_seed(session_seed + 7 * rows)
    _two_parts_within_the_bound(builds, generator, type_name, rows, 48, session_seed)


@pytest.mark.parametrize("rows", (40, 150))
@pytest.mark.parametrize("type_name", ("Q4_K", "Q6_K", "Q4_1"))
def test_strips_of_every_part_land_in_their_columns(builds, type_name, rows, session_seed):
    """Parts of 11 blocks (176 rows: a whole strip of 128 and a short one in
    every strip form), two of them: the threads take strips of both parts
    from one counter (kernels/cpu/csrc/work_items.h), and each strip's sums
    land in its own part's columns."""
    generator = torch.Generator().manual_seed(session_seed + rows)
    _two_parts_within_the_bound(builds, generator, type_name, rows, 176, session_seed)


@pytest.mark.parametrize("in_features", (8192, 16384))
@pytest.mark.parametrize("type_name", ("Q4_K", "Q6_K", "Q8_0"))
def test_long_rows_take_narrower_strips(builds, type_name, in_features, session_seed):
    """Past 4,096 inputs a strip of the int8 form is two columns of 16 rows,
    past ~10,000 one, so that the decoded strip stays in L2 (quant_vnni.h's
    columns_for): 37 rows end on a short column of 5, and 50 tokens on a
    tile of 2 after twelve of 4."""
    generator = torch.Generator().manual_seed(session_seed + in_features)
    _within_the_bound(builds, generator, [type_name], 50, 37, in_features,
                      f"{type_name} K={in_features} seed {session_seed}")


def _two_parts_within_the_bound(builds, generator, type_name, rows, out_features, session_seed):
    """Parts of `type_name` and Q8_0, `out_features` rows each, times `rows`
    bf16 tokens of 512 inputs."""
    _within_the_bound(builds, generator, [type_name, "Q8_0"], rows, out_features, 512,
                      f"{type_name} rows={rows} seed {session_seed}")


def _within_the_bound(builds, generator, type_names, rows, out_features, in_features, what):
    """`rows` bf16 tokens (and a bias) against parts of `type_names`,
    `out_features` rows each: every build within the activation bound."""
    blob, _, x, bias = _inputs(generator, type_names, rows, out_features, in_features, torch.bfloat16)
    expected = quant_linear_reference(x, blob, bias, float_out=True)
    bound = _bound(x, blob, torch.float32, expected)
    for isa, ops in builds.items():
        worst = ((ops.quant_linear(x, blob, bias, True) - expected).abs() / bound).max().item()
        assert worst <= 1, f"{isa} {what}: {worst:.2f}x the bound"


# The bytes of a block that hold its codes (the rest: scales, mins).
CODE_BYTES = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q5_0": (2, 22), "Q5_1": (4, 24), "Q8_0": (2, 34),
              "Q4_K": (16, 144), "Q5_K": (16, 176), "Q6_K": (0, 192)}


@pytest.mark.parametrize("rows", (1, 16, 42))
@pytest.mark.parametrize("type_name", TYPES)
def test_the_largest_codes_meet_the_largest_tokens(builds, type_name, rows, session_seed):
    """Every code at its largest stored value (Q8_0's at -128) against tokens
    whose every code is 127 (-127 for Q8_0): the sums the int8 strips keep in
    int16 before widening (quant_maddubs.h's steps_in_int16, 4-bit types a
    whole group) and in maddubs's saturating pairs are at their largest
    here, so a step too many or a sign taken the wrong way shows."""
    generator = torch.Generator().manual_seed(session_seed + rows)
    kind = QUANT_TYPES[type_name]
    in_features, out_features = 2 * 256, 37
    data = random_quant_blocks(type_name, out_features, in_features, generator)
    blocks = data.view(-1, kind.block_bytes)
    first, last = CODE_BYTES[type_name]
    blocks[:, first:last] = 0x80 if type_name == "Q8_0" else 0xFF
    blob = pack_quant_weight([(type_name, data)], in_features)
    sign = -1.0 if type_name == "Q8_0" else 1.0
    x = torch.full((rows, in_features), 0.5 * sign)
    expected = quant_linear_reference(x, blob, None, float_out=True)
    bound = _bound(x, blob, torch.float32, expected)
    for isa, ops in builds.items():
        got = ops.quant_linear(x, blob, None, True)
        worst = ((got - expected).abs() / bound).max().item()
        assert worst <= 1, f"{isa} {type_name} rows={rows} seed {session_seed}: {worst:.2f}x the bound"


@pytest.mark.parametrize("type_name", ("Q4_K", "Q6_K", "Q8_0"))
def test_a_token_gets_the_same_sums_in_a_decode_batch_and_a_prefill(builds, type_name, session_seed):
    """40 tokens (a decode batch) and 150 (a prefill) take different strip
    forms where the CPU has AMX (rows as A, or the packed layout as B): a
    token's sums walk its inputs in the same order either way, bit for bit."""
    amx = {isa: ops for isa, ops in builds.items() if ops.amx()}
    if not amx:
        pytest.skip("this CPU has no AMX: the other builds keep one strip form")
    generator = torch.Generator().manual_seed(session_seed)
    blob, _, x, bias = _inputs(generator, [type_name, "Q8_0"], 150, 48, 512, torch.bfloat16)
    for isa, ops in amx.items():
        few, many = ops.quant_linear(x[:40], blob, bias, False), ops.quant_linear(x, blob, bias, False)
        assert few.equal(many[:40]), f"{isa} {type_name} seed {session_seed}"


def test_mixed_parts_and_float_out(builds, session_seed):
    generator = torch.Generator().manual_seed(session_seed)
    blob, _, x, bias = _inputs(generator, ["Q4_K", "Q6_K", "Q8_0"], 7, 11, 512, torch.bfloat16)
    expected = quant_linear_reference(x, blob, bias, float_out=True)
    bound = _bound(x, blob, torch.float32, expected)
    for ops in builds.values():
        got = ops.quant_linear(x, blob, bias, True)
        assert got.dtype == torch.float32 and got.shape == (7, 33)
        assert bool(((got - expected).abs() <= bound).all())


def test_the_dispatch_and_the_reference_agree_on_shapes(session_seed):
    """Leading dimensions of x pass through the dispatch; the sums stay within
    the activation bound of the reference's (a fixed tolerance against the
    float product failed now and then: an output near zero after
    cancellation carries the rounding of every input block)."""
    generator = torch.Generator().manual_seed(session_seed)
    blob, weight, x, _ = _inputs(generator, ["Q8_0"], 4, 9, 64, torch.float32)
    got = kernels.quant_linear(x.view(2, 2, 64), blob)
    assert got.shape == (2, 2, 9)
    expected = quant_linear_reference(x, blob, None, float_out=True)
    bound = _bound(x, blob, torch.float32, expected)
    assert bool(((got.view(4, 9) - expected).abs() <= bound).all()), f"seed {session_seed}"
    assert kernels.quant_dequantize(blob).equal(weight)


def test_a_blob_of_another_width_is_refused(builds, session_seed):
    generator = torch.Generator().manual_seed(session_seed)
    blob = _blob(generator, ["Q4_0"], 3, 64)
    for ops in builds.values():
        with pytest.raises(RuntimeError, match=r"x must be \[tokens, 64\]"):
            ops.quant_linear(torch.zeros(1, 96), blob, None)
        with pytest.raises(RuntimeError, match="quantized blob"):
            ops.quant_linear(torch.zeros(1, 64), torch.zeros(64, dtype=torch.float32), None)


# -- 16-row panels (kernels/quant.py): Q4_K, Q5_K and Q6_K; Q4_0, Q4_1, Q5_0 and Q5_1 ------------

# Blobs of panels: one type, Q4_K_M's and Q5_K_M's fused qkv (q and k Q4_K or Q5_K, v Q6_K), the
# legacy types together.
PANEL_PARTS = (["Q4_K", "Q4_K"], ["Q6_K", "Q6_K"], ["Q4_K", "Q6_K"], ["Q5_K", "Q5_K"], ["Q5_K", "Q6_K"],
               ["Q4_0", "Q4_0"], ["Q4_1", "Q4_1"], ["Q5_0", "Q5_0"], ["Q5_1", "Q5_1"],
               ["Q4_1", "Q5_0", "Q4_0", "Q5_1"])


def _panels_round_trip(name, rows, in_features, generator):
    """Random valid blocks of `name` and their panels, checked to come back whole."""
    data = random_quant_blocks(name, rows, in_features, generator)
    panels = to_panels(name, data)
    assert panels.shape == data.shape and torch.equal(from_panels(name, panels), data)
    return data, panels


def test_panels_are_the_file_bytes_reordered(session_seed):
    generator = torch.Generator().manual_seed(session_seed)
    data, panels = _panels_round_trip("Q4_K", 48, 512, generator)
    assert not torch.equal(panels, data)
    # row 5 of the first panel, super-block 1: where its d, scale byte 7 and code byte 77 went
    chunk, block = panels.view(3, 2, 2304)[0, 1], data[5, 144:288]
    assert chunk[20:24].tolist() == block[:4].tolist()
    assert chunk[64 + 16 * 7 + 5] == block[4 + 7]
    assert chunk[256 + 512 * 2 + 64 * 3 + 4 * 5 + 1] == block[16 + 32 * 2 + 4 * 3 + 1]
    blob = pack_quant_weight([("Q4_K", data), ("Q4_K", data[:16])], 512)
    paneled = pack_quant_panels(blob)
    assert has_panels(paneled) and not has_panels(blob) and paneled.numel() == blob.numel()
    for (name, got), (want_name, want) in zip(quant_parts(paneled), quant_parts(blob)):
        assert name == want_name and torch.equal(got, want)
    for types in (["Q4_K", "Q8_0"], ["Q5_K", "Q4_0"], ["Q4_1", "Q8_0"], ["Q5_0", "Q8_0"]):
        other = _blob(generator, types, 32, 512)
        assert pack_quant_panels(other) is other  # one family a blob: K-quants, or the legacy 4- and 5-bit
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        pack_quant_weight([("Q4_K", data[:24])], 512, panels=True)


def test_q6k_panels_are_the_file_bytes_reordered(session_seed):
    generator = torch.Generator().manual_seed(session_seed)
    data, panels = _panels_round_trip("Q6_K", 32, 512, generator)
    # row 9 of the second panel, super-block 1: its ql word 5, qh word 3, scale 11 and d
    chunk, block = panels.view(2, 2, 3360)[1, 1], data[16 + 9, 210:420]
    assert chunk[64 * 5 + 4 * 9:][:4].tolist() == block[4 * 5:][:4].tolist()
    assert chunk[2048 + 64 * 3 + 4 * 9:][:4].tolist() == block[128 + 4 * 3:][:4].tolist()
    assert chunk[3072 + 16 * 11 + 9] == block[192 + 11]
    assert chunk[3328 + 2 * 9:][:2].tolist() == block[208:210].tolist()
    qkv = _blob(generator, ["Q4_K", "Q6_K"], 32, 512)
    paneled = pack_quant_panels(qkv)
    assert has_panels(paneled) and paneled.numel() == qkv.numel()
    for (name, got), (want_name, want) in zip(quant_parts(paneled), quant_parts(qkv)):
        assert name == want_name and torch.equal(got, want)


def test_q5k_panels_are_the_file_bytes_reordered(session_seed):
    generator = torch.Generator().manual_seed(session_seed)
    data, panels = _panels_round_trip("Q5_K", 32, 512, generator)
    # row 3 of the second panel, super-block 1: its d and dmin, scale byte 9, qh word 6, code word 21
    chunk, block = panels.view(2, 2, 2816)[1, 1], data[16 + 3, 176:352]
    assert chunk[4 * 3:][:4].tolist() == block[:4].tolist()
    assert chunk[64 + 16 * 9 + 3] == block[4 + 9]
    assert chunk[256 + 64 * 6 + 4 * 3:][:4].tolist() == block[16 + 4 * 6:][:4].tolist()
    assert chunk[768 + 64 * 21 + 4 * 3:][:4].tolist() == block[48 + 4 * 21:][:4].tolist()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_legacy_panels_are_the_file_bytes_reordered(name, session_seed):
    generator = torch.Generator().manual_seed(session_seed)
    data, panels = _panels_round_trip(name, 32, 96, generator)  # 3 blocks a row
    # row 7 of the second panel, block 2: its d, m (the _1 types), qh (the Q5 types) and nibble word 3
    size = QUANT_TYPES[name].block_bytes
    chunk, block = panels.view(2, 3, 16 * size)[1, 2], data[16 + 7, 2 * size:3 * size]
    assert chunk[2 * 7:][:2].tolist() == block[:2].tolist()
    qh = 4 if name.endswith("_1") else 2  # where a block's fifth bits (the Q5 types) start
    codes = qh + (4 if name.startswith("Q5") else 0)  # where its nibbles start
    if name.endswith("_1"):
        assert chunk[32 + 2 * 7:][:2].tolist() == block[2:4].tolist()
    if name.startswith("Q5"):
        assert chunk[16 * qh + 4 * 7:][:4].tolist() == block[qh:qh + 4].tolist()
    assert chunk[16 * codes + 64 * 3 + 4 * 7:][:4].tolist() == block[codes + 4 * 3:][:4].tolist()


@pytest.mark.parametrize("types", PANEL_PARTS, ids="+".join)
def test_panels_dequantize_bit_for_bit(builds, types, session_seed):
    """Every build reads a panel blob's weights back as gguf's numbers."""
    generator = torch.Generator().manual_seed(session_seed)
    blob = _blob(generator, types, 32, 768, zero_rows=3)
    paneled = pack_quant_panels(blob)
    expected = dequantize_reference(blob)
    rows = torch.randint(0, 64, (20,), generator=generator)
    for isa, ops in builds.items():
        assert torch.equal(ops.quant_dequantize(paneled, None), expected), isa
        assert torch.equal(ops.quant_dequantize(paneled, rows), expected[rows]), isa


@pytest.mark.parametrize("types", PANEL_PARTS, ids="+".join)
@pytest.mark.parametrize("shape", [(1, 768), (3, 768), (13, 768), (16, 768), (128, 768), (5, 8192)])
def test_panels_product_is_within_the_activation_bound(builds, shape, types, session_seed):
    """The AVX512-VNNI builds (avx512bf16, avx512) multiply panels at every
    token count (their int8 strips; tokens rounded per 256 against K-quants,
    per 32 against the legacy types); the other builds refuse them."""
    rows, in_features = shape
    generator = torch.Generator().manual_seed(session_seed)
    blob = _blob(generator, types, 48, in_features, zero_rows=2)
    paneled = pack_quant_panels(blob)
    bias = torch.randn(48 * len(types), generator=generator)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        expected = quant_linear_reference(x, blob, bias, True)
        bound = _bound(x, blob, torch.float32, expected)
        for isa, ops in builds.items():
            if isa not in ("avx512bf16", "avx512"):
                with pytest.raises(RuntimeError, match="16-row panels"):
                    ops.quant_linear(x, paneled, bias, True)
                continue
            got = ops.quant_linear(x, paneled, bias, True)
            worst = ((got - expected).abs() / bound).max().item()
            assert worst <= 1, f"{isa} {dtype} {shape} seed {session_seed}: {worst:.2f}x the bound"
            if rows >= 8 and dtype == torch.bfloat16:  # the strips either way: the same sums
                assert torch.equal(got, ops.quant_linear(x, blob, bias, True)), (isa, shape)
            if rows < 8 and _token_block(blob) == 32:
                # the file order's rows round the tokens alike: only the order of the float sums differs
                file_rows = ops.quant_linear(x, blob, bias, True)
                tight = x.float().abs() @ dequantize_reference(blob).abs().t() * 4e-5 + 1e-30
                worst = ((got - file_rows).abs() / tight).max().item()
                assert worst <= 1, f"{isa} {dtype} {shape}: {worst:.2f}x float32's rounding off the file order's"


def _tokens_kept_exactly(generator, rows: int, in_features: int, dtype) -> torch.Tensor:
    """Tokens the 8-bit rounding keeps exactly: every block of 32 inputs is
    integers of -127..127 with a +-127 among them, times a power of two that
    each block of 256 shares (each of 32 where a row is not whole blocks of
    256), so per 32 or per 256 the scale is that power and every code the
    integer."""
    blocks = in_features // 32
    codes = torch.randint(-127, 128, (rows, blocks, 32), generator=generator)
    where = torch.randint(0, 32, (rows, blocks, 1), generator=generator)
    sign = torch.randint(0, 2, (rows, blocks, 1), generator=generator) * 2 - 1
    codes.scatter_(2, where, 127 * sign)
    share = 8 if in_features % 256 == 0 else 1
    power = torch.exp2(torch.randint(-8, 5, (rows, blocks // share, 1), generator=generator).float())
    return (codes * power.repeat_interleave(share, 1)).reshape(rows, in_features).to(dtype)


@pytest.mark.parametrize("type_name", TYPES)
def test_tokens_the_rounding_keeps_give_the_float_product(builds, type_name, session_seed):
    """Where the 8-bit rounding of the tokens loses nothing, the integer
    forms owe the reference only float32's rounding of their sums:
    |y - y_ref| <= 2^-17 sum |x| |w|, about a thousandth of the activation
    bound, so a constant of a tile's bookkeeping a little off (the running
    sums' base of quant_vnni.h 0.1 % short) fails here where it passes that
    bound.  The forms: every count of tokens on the AVX2 build (its rows
    and maddubs strips), bf16 tokens on the AVX512 build where AMX does not
    take them (its lanes and VNNI strips), and a blob in panels on a build
    that makes them, at any dtype; the others multiply de-quantized floats."""
    generator = torch.Generator().manual_seed(session_seed)
    in_features = 3 * 256 if QUANT_TYPES[type_name].block_elems == 256 else 13 * 32
    blob = _blob(generator, [type_name, type_name], 48, in_features, zero_rows=2)
    paneled = pack_quant_panels(blob) if can_panel(quant_parts(blob)) else None
    magnitude_of = dequantize_reference(blob).abs().t()
    checked = 0
    for rows in (1, 3, 16, 42, 128):
        for dtype in (torch.float32, torch.bfloat16):
            x = _tokens_kept_exactly(generator, rows, in_features, dtype)
            expected = quant_linear_reference(x, blob, None, float_out=True)
            tight = x.float().abs() @ magnitude_of * 2.0**-17 + 1e-30
            for isa, ops in builds.items():
                forms = []
                if isa in ("avx2", "avx512") or (isa == "avx512bf16" and dtype == torch.bfloat16 and not ops.amx()):
                    forms.append(("file order", blob))
                if paneled is not None and ops.quant_panels():
                    forms.append(("panels", paneled))
                for form, weight in forms:
                    got = ops.quant_linear(x, weight, None, True)
                    worst = ((got - expected).abs() / tight).max().item()
                    assert worst <= 1, (f"{isa} {form} {type_name} {dtype} rows={rows} seed {session_seed}: "
                                        f"{worst:.2f}x float32's rounding")
                    checked += 1
    if not checked:
        pytest.skip("no build here multiplies int8 tokens")
