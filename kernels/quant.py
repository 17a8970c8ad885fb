"""Quantized weights in GGUF's block formats: the blob that carries them, and
the reference every kernel is held to.

A quantized linear weight is one 1-D uint8 tensor, the *blob*, so that it
travels through the compiled ops' `Tensor` weight arguments (the fused
decoder-layer op takes it where a bf16 weight would go, and picks the
quantized product by its dtype)::

    header, int64 little-endian words, zero-padded to a multiple of 64 bytes:
      [0] MAGIC  [1] VERSION  [2] K = in_features  [3] N = out_features
      [4] P = parts  [5..7] 0
      then per part: ggml type id, rows, byte offset of its data, row_bytes
    each part's data at a multiple of 64 bytes: rows x row_bytes, every row
    that row's GGUF blocks in file order (row_bytes = K / block_elems * block_bytes)

Parts stack along N in order: a fused q|k|v projection is three parts, and a
Q4_K_M file gives them different types (Q4_K q and k, Q6_K v). The rows are
the file's bytes unchanged, so de-quantizing them gives the file's numbers
bit for bit (tests/kernels/test_quant_linear.py holds the compiled decoder to
`gguf.quants.dequantize`, the reference here).

Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0 and Q5_1 weights may be stored in
*panels* of 16 rows instead (header word [5], FLAGS, bit 0: every part of
the blob in whole panels, the K-quants together or the legacy 4- and 5-bit
types together, as their tokens are rounded per 256 or per 32), where the
compiled op reads them
(``pack_quant_panels``): the same bytes, reordered so that 16 rows sit side
by side as the AVX512-VNNI kernels multiply them. A panel's block (16
blocks: 2,304 bytes for Q4_K, 2,816 for Q5_K, 3,360 for Q6_K, 288 for Q4_0,
320 for Q4_1, 352 for Q5_0, 384 for Q5_1)
holds each field of the block in turn, in the block's order, word by word
across the 16 rows (``PANEL_FIELDS``)::

    Q4_K  [16 rows][4]        each row's d and dmin (fp16)
          [12][16 rows]       byte j of each row's packed 6-bit scales and mins
          [32][16 rows][4]    code word w (bytes 4 w .. + 3) of each row
    Q5_K  as Q4_K, with [8][16 rows][4] qh word u (the fifth bits) before the codes
    Q6_K  [32][16 rows][4]    ql word w: 4 inputs' low nibbles (two runs of 32)
          [16][16 rows][4]    qh word u: the same inputs' 2-bit highs (four runs)
          [16][16 rows]       each row's 16 int8 sub-block scales
          [16 rows][2]        each row's d (fp16)
    Q4_0  [16 rows][2]        each row's d (fp16)
          [4][16 rows][4]     nibble word w: inputs 4 w .. + 3 low, 16 + 4 w .. high
    Q4_1  [16 rows][2], [16 rows][2], [4][16 rows][4]: d, m, then the same words
    Q5_0, Q5_1  as Q4_0, Q4_1, with [16 rows][4] qh (the fifth bits) before the words

Why: one int32 lane a row, a lane sums a whole sub-block before its scale,
where in the file's order each dot product of 64 weights takes its own
conversion and FMA (kernels/cpu/csrc/quant_panels.h). A permutation, not a
conversion: ``quant_parts`` undoes it, and de-quantizing gives the file's
numbers bit for bit in either order.

The reference product de-quantizes (numpy, exact) and multiplies in float32;
the compiled op (kernels/cpu/csrc/quant_linear.h) quantizes each activation
row per 32 inputs to 8 bits and multiplies integers, as llama.cpp does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

MAGIC = 0x57515350  # "PSQW"
VERSION = 1
HEADER_WORDS = 8
PART_WORDS = 4
ALIGN = 64
FLAGS_WORD = 5
PANELS = 1  # FLAGS bit: every part is in 16-row panels
PANEL_ROWS = 16
# A panel's fields per type, in the block's order: (first byte, bytes, word).
# The C++ reader (kernels/cpu/csrc/quant_blob.h, kPanelFields) holds the same table.
PANEL_FIELDS = {"Q4_K": ((0, 4, 4), (4, 12, 1), (16, 128, 4)),
                "Q5_K": ((0, 4, 4), (4, 12, 1), (16, 32, 4), (48, 128, 4)),
                "Q6_K": ((0, 128, 4), (128, 64, 4), (192, 16, 1), (208, 2, 2)),
                "Q4_0": ((0, 2, 2), (2, 16, 4)),
                "Q4_1": ((0, 2, 2), (2, 2, 2), (4, 16, 4)),
                "Q5_0": ((0, 2, 2), (2, 4, 4), (6, 16, 4)),
                "Q5_1": ((0, 2, 2), (2, 2, 2), (4, 4, 4), (8, 16, 4))}
# Types that may share a blob in panels: the tokens meet a blob at one rounding
# (per 256 inputs for K-quants, per 32 for the legacy types).
# Q8_0 stays in the file's order: its rows there read as fast once K is past
# ~1,500 inputs (docs/performance.md, 2026-12-04 evening).
PANEL_FAMILIES = (frozenset({"Q4_K", "Q5_K", "Q6_K"}), frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1"}))


@dataclass(frozen=True)
class QuantType:
    name: str
    ggml_id: int
    block_elems: int  # weights per block
    block_bytes: int

    def row_bytes(self, in_features: int) -> int:
        if in_features % self.block_elems:
            raise ValueError(f"{self.name} needs in_features divisible by {self.block_elems}, "
                             f"got {in_features}")
        return in_features // self.block_elems * self.block_bytes


def _quant_types() -> dict[str, QuantType]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    names = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
    return {name: QuantType(name, int(GGMLQuantizationType[name]),
                            *GGML_QUANT_SIZES[GGMLQuantizationType[name]]) for name in names}


QUANT_TYPES = _quant_types()
_BY_ID = {t.ggml_id: t for t in QUANT_TYPES.values()}


def is_quant_weight(tensor) -> bool:
    """Whether a weight is a blob (uint8) rather than floats."""
    return isinstance(tensor, torch.Tensor) and tensor.dtype == torch.uint8


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack_quant_weight(parts: Sequence[tuple[str, torch.Tensor]], in_features: int,
                      panels: bool = False) -> torch.Tensor:
    """One blob of the parts (type name, uint8 [rows, row_bytes]), stacked
    along N; with `panels`, each part's rows in 16-row panels (``can_panel``
    must hold)."""
    if panels and not can_panel(parts):
        raise ValueError("16-row panels take parts of a multiple of 16 rows, all Q4_K, Q5_K or Q6_K, "
                         "or all Q4_0, Q4_1, Q5_0 or Q5_1, got "
                         f"{[(name, tuple(data.shape)) for name, data in parts]}")
    header = [MAGIC, VERSION, in_features, sum(p.shape[0] for _, p in parts), len(parts),
              PANELS if panels else 0, 0, 0]
    offset = _align(8 * (HEADER_WORDS + PART_WORDS * len(parts)))
    places = []
    for name, data in parts:
        kind = QUANT_TYPES.get(name)
        if kind is None:
            raise ValueError(f"quant type {name!r} is not one of {tuple(QUANT_TYPES)}")
        row_bytes = kind.row_bytes(in_features)
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != row_bytes:
            raise ValueError(f"a {name} part of {in_features} inputs is uint8 [rows, {row_bytes}], "
                             f"got {data.dtype} {tuple(data.shape)}")
        header += [kind.ggml_id, data.shape[0], offset, row_bytes]
        places.append((offset, to_panels(name, data) if panels else data))
        offset = _align(offset + data.numel())
    blob = torch.zeros(offset, dtype=torch.uint8)
    blob[:8 * len(header)] = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
    for start, data in places:
        blob[start:start + data.numel()] = data.reshape(-1)
    return blob


def can_panel(parts: Sequence[tuple[str, torch.Tensor]]) -> bool:
    """Whether the parts can be stored in 16-row panels: whole panels, every
    type of one family (``PANEL_FAMILIES``)."""
    names = {name for name, _ in parts}
    return (bool(parts) and any(names <= family for family in PANEL_FAMILIES)
            and all(data.shape[0] % PANEL_ROWS == 0 for _, data in parts))


def _panel_view(type_name: str, data: torch.Tensor) -> tuple[int, int, int]:
    """(panels, blocks a row, bytes a block) of a part."""
    block = QUANT_TYPES[type_name].block_bytes
    return data.shape[0] // PANEL_ROWS, data.shape[1] // block, block


def to_panels(type_name: str, data: torch.Tensor) -> torch.Tensor:
    """A part's rows (uint8 [rows, row_bytes], a type of ``PANEL_FIELDS``) in 16-row panels
    (the layout in the module docstring), the same shape and bytes reordered."""
    panels, blocks, block = _panel_view(type_name, data)
    rows = data.reshape(panels, PANEL_ROWS, blocks, block)
    fields = [rows[..., start:start + size].reshape(panels, PANEL_ROWS, blocks, size // word, word)
              .permute(0, 2, 3, 1, 4).reshape(panels, blocks, PANEL_ROWS * size)
              for start, size, word in PANEL_FIELDS[type_name]]
    return torch.cat(fields, dim=-1).reshape(data.shape)


def from_panels(type_name: str, data: torch.Tensor) -> torch.Tensor:
    """``to_panels`` undone: the rows in the file's order (a copy)."""
    panels, blocks, block = _panel_view(type_name, data)
    chunks = data.reshape(panels, blocks, PANEL_ROWS * block)
    fields, at = [], 0
    for _, size, word in PANEL_FIELDS[type_name]:
        field = chunks[..., at:at + PANEL_ROWS * size].reshape(panels, blocks, size // word, PANEL_ROWS, word)
        fields.append(field.permute(0, 3, 1, 2, 4).reshape(panels, PANEL_ROWS, blocks, size))
        at += PANEL_ROWS * size
    return torch.cat(fields, dim=-1).reshape(data.shape)


def has_panels(blob: torch.Tensor) -> bool:
    """Whether a blob's parts are stored in 16-row panels."""
    return bool(_header(blob)[FLAGS_WORD] & PANELS)


def _header(blob: torch.Tensor) -> list[int]:
    words = blob[:8 * HEADER_WORDS].view(torch.int64).tolist()
    if words[0] != MAGIC or words[1] != VERSION:
        raise ValueError("not a quantized weight blob (kernels/quant.py)")
    parts = words[4]
    return blob[:8 * (HEADER_WORDS + PART_WORDS * parts)].view(torch.int64).tolist()


def quant_shape(blob: torch.Tensor) -> tuple[int, int]:
    """(out_features, in_features) of a blob."""
    words = _header(blob)
    return words[3], words[2]


def quant_parts(blob: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The blob's parts: (type name, uint8 [rows, row_bytes] of GGUF rows in
    the file's order: a view into the blob, or a copy where it holds panels)."""
    words = _header(blob)
    panels = bool(words[FLAGS_WORD] & PANELS)
    parts = []
    for p in range(words[4]):
        type_id, rows, offset, row_bytes = words[HEADER_WORDS + PART_WORDS * p:][:PART_WORDS]
        data = blob[offset:offset + rows * row_bytes].view(rows, row_bytes)
        name = _BY_ID[type_id].name
        parts.append((name, from_panels(name, data) if panels else data))
    return parts


def pack_quant_panels(blob: torch.Tensor) -> torch.Tensor:
    """The blob with its parts in 16-row panels where they can be (``can_panel``), else itself."""
    parts = quant_parts(blob)
    if has_panels(blob) or not can_panel(parts):
        return blob
    return pack_quant_weight(parts, quant_shape(blob)[1], panels=True)


def dequantize_part(type_name: str, data: torch.Tensor) -> torch.Tensor:
    """float32 [rows, K] of one part, by gguf.quants.dequantize (the oracle)."""
    from gguf import GGMLQuantizationType, quants

    values = quants.dequantize(data.numpy(), GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def select_rows(blob: torch.Tensor, rows: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """`rows` (int64 [n] indices into the blob's N rows, repeats allowed) by
    part: (type name, uint8 [n_i, row_bytes] of the part's wanted rows, their
    positions in `rows`) for each part that holds any."""
    if rows.dim() != 1 or rows.dtype != torch.int64:
        raise ValueError(f"rows must be int64 [n], got {rows.dtype} {tuple(rows.shape)}")
    count = quant_shape(blob)[0]
    if rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < count):
        raise IndexError(f"rows {rows.tolist()[:8]}... index a blob of {count} rows")
    selected, start = [], 0
    for name, data in quant_parts(blob):
        where = ((rows >= start) & (rows < start + data.shape[0])).nonzero().flatten()
        if where.numel():
            selected.append((name, data[rows[where] - start], where))
        start += data.shape[0]
    return selected


def dequantize_reference(blob: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [N, K]: every part de-quantized by gguf's own code; with
    `rows`, those rows only, in their order ([len(rows), K])."""
    if rows is None:
        return torch.cat([dequantize_part(name, data) for name, data in quant_parts(blob)])
    out = torch.empty(rows.numel(), quant_shape(blob)[1], dtype=torch.float32)
    for name, data, where in select_rows(blob, rows):
        out[where] = dequantize_part(name, data)
    return out


def quant_linear_reference(x: torch.Tensor, blob: torch.Tensor, bias: torch.Tensor | None = None,
                           float_out: bool = False) -> torch.Tensor:
    """x @ W.T (+ bias) over the exact de-quantized W, in float32; out in x's
    dtype (float32 with float_out)."""
    out = x.float() @ dequantize_reference(blob).t()
    if bias is not None:
        out = out + bias.float()
    return out if float_out else out.to(x.dtype)


def quantize_weight(weight: torch.Tensor, type_name: str) -> torch.Tensor:
    """A float [N, K] weight as a one-part blob of `type_name`, round to
    nearest: gguf's own quantizer for the legacy types, kernels/quantize_k.py
    for Q4_K (gguf writes no K-quants)."""
    from gguf import GGMLQuantizationType, quants

    values = weight.detach().float().cpu().numpy()
    if type_name == "Q4_K":
        from kernels.quantize_k import quantize_q4_k

        data = quantize_q4_k(values)
    elif type_name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        QUANT_TYPES[type_name].row_bytes(weight.shape[1])  # a clear error for a bad width
        data = quants.quantize(values, GGMLQuantizationType[type_name])
    else:
        raise ValueError(f"cannot quantize into {type_name!r}: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K")
    return pack_quant_weight([(type_name, torch.from_numpy(np.ascontiguousarray(data)))],
                             weight.shape[1])


def random_quant_blocks(type_name: str, rows: int, in_features: int,
                        generator: torch.Generator) -> torch.Tensor:
    """uint8 [rows, row_bytes] of random *valid* blocks (tests, benchmarks):
    random bytes, with every fp16 scale field set to a finite value, drawn
    to include the extremes (subnormal, ~6e4, negative, zero)."""
    kind = QUANT_TYPES[type_name]
    data = torch.randint(0, 256, (rows, kind.row_bytes(in_features)), dtype=torch.uint8,
                         generator=generator)
    blocks = data.view(-1, kind.block_bytes)
    for field in _scale_fields(type_name):
        picks = torch.randint(0, len(_SCALES), (blocks.shape[0],), generator=generator)
        values = _SCALES[picks] * torch.rand(blocks.shape[0], generator=generator).add(0.5)
        blocks[:, field:field + 2] = values.to(torch.float16).view(torch.uint8).view(-1, 2)
    return data


# Scale magnitudes a valid block may hold: ordinary, tiny (subnormal in fp16), huge, zero.
_SCALES = torch.tensor([1e-3, 2e-2, -3e-2, 1e-6, 3e4, 0.0, 1.0])


def _scale_fields(type_name: str) -> tuple[int, ...]:
    """Byte offsets of a block's fp16 scale fields (d, and m or dmin)."""
    return {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
            "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[type_name]
