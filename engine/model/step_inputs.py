"""One step's model inputs as a flat run of integers, and back as tensors.

The runner turns the scheduler's output into integers once (`encode_step`):
a fixed header of counts, then every list the forward pass reads, end to end.

    header   [op, tokens T, decodes D, decode width Wd, prefills P, prefill width Wp,
              sampled rows S, block copies C,
              window group G (0 or 1), window widths Xd Xp, window copies Xc,
              adapters L (0 or 1)]
    payload  input_ids[T] positions[T] slot_mapping[T]
             decode_block_tables[D x Wd] decode_context_lens[D]
             prefill_block_tables[P x Wp] prefill_cu_seqlens_q[P + 1] prefill_context_lens[P]
             sample_rows[S] block_copies[C x 2]
             (G = 1:) window_slot_mapping[T] window_decode_tables[D x Xd]
                      window_prefill_tables[P x Xp] window_copies[Xc x 2]
             (L = 1:) lora_ids[T]: each token's LoRA adapter (0: the base model)

The window part is the sliding layers' own pool of a model that mixes sliding
and global layers (engine/core/hybrid_blocks.py): the same tokens and lengths,
other blocks. The adapters' part is there when some sequence runs under a
LoRA adapter: every rank maps the ids to its own slots (engine/model/lora/).

`decode_step` cuts the payload back into tensors: views of one int64 tensor
and a few int32 copies, after a single host-to-device transfer. With tensor
parallelism the same two pieces are what rank 0 broadcasts every step (the
header, then the payload): a worker learns the step from them alone, and
every rank decodes them the same way, so their forward passes line up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import IntEnum

import torch

from engine.model.attention_metadata import AttentionMetadata
from engine.core.sched_output import ScheduledSequence

HEADER_LEN = 13


class Op(IntEnum):
    """What a header asks of the ranks: a step, or a command between steps."""

    STOP = 0  # header only: the workers exit
    STEP = 1
    READ_BLOCKS = 2  # header [op, n]; payload: n block ids
    WRITE_BLOCKS = 3  # header [op, n]; payload: n block ids, then the blocks' bytes
    ADD_LORA = 4  # header [op, n]; payload: n bytes, the LoRARequest as JSON
    REMOVE_LORA = 5  # header [op, lora_int_id]


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # long [T]
    positions: torch.Tensor  # long [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # long [S]: the rows whose logits are sampled
    copy_sources: torch.Tensor  # long [C]: copy-on-write block pairs, applied first
    copy_destinations: torch.Tensor  # long [C]
    window_copies: torch.Tensor | None = None  # long [Xc, 2]: the window pool's pairs
    lora_ids: torch.Tensor | None = None  # long [T]: each row's adapter (None: all the base)


def encode_step(decodes: list[ScheduledSequence], prefills: list[ScheduledSequence],
                sample_rows: list[int], copies: list[tuple[int, int]], block_size: int,
                window_copies: list[tuple[int, int]] = ()) -> tuple[list[int], torch.Tensor]:
    """The header and the int64 payload of a step whose tokens run decodes first."""
    ordered = decodes + prefills
    input_ids: list[int] = []
    positions: list[int] = []
    for s in ordered:
        input_ids.extend(s.token_ids)
        positions.extend(range(s.start_position, s.context_len))
    tables = [s.block_table for s in ordered]
    decode_width, decode_tables = _padded_tables(tables[:len(decodes)])
    prefill_width, prefill_tables = _padded_tables(tables[len(decodes):])
    cu_seqlens = [0]
    for s in prefills:
        cu_seqlens.append(cu_seqlens[-1] + s.num_new_tokens)
    payload = (
        input_ids + positions + _slots(ordered, tables, block_size)
        + decode_tables + [s.context_len for s in decodes]
        + prefill_tables + cu_seqlens + [s.context_len for s in prefills]
        + sample_rows + [block for pair in copies for block in pair]
    )
    header = [Op.STEP, len(input_ids), len(decodes), decode_width, len(prefills),
              prefill_width, len(sample_rows), len(copies), 0, 0, 0, 0, 0]
    if ordered and ordered[0].window_block_table is not None:
        header[8:12], window = _window_part(decodes, ordered, window_copies, block_size)
        payload += window
    if any(s.lora_id for s in ordered):
        header[12] = 1
        payload += [s.lora_id for s in ordered for _ in range(s.num_new_tokens)]
    return header, torch.tensor(payload, dtype=torch.long)


def _window_part(decodes, ordered, copies, block_size) -> tuple[list[int], list[int]]:
    """The window group's header fields and payload (the same layout as the main one's)."""
    tables = [s.window_block_table for s in ordered]
    decode_width, decode_tables = _padded_tables(tables[:len(decodes)])
    prefill_width, prefill_tables = _padded_tables(tables[len(decodes):])
    payload = (_slots(ordered, tables, block_size) + decode_tables + prefill_tables
               + [block for pair in copies for block in pair])
    return [1, decode_width, prefill_width, len(copies)], payload


def _slots(ordered: list[ScheduledSequence], tables: list[list[int]], block_size: int) -> list[int]:
    """The cache slot of every new token: block_table[p // block_size] * block_size + p % block_size."""
    slots: list[int] = []
    for s, table in zip(ordered, tables):
        slots.extend(table[p // block_size] * block_size + p % block_size
                     for p in range(s.start_position, s.context_len))
    return slots


def _padded_tables(tables: list[list[int]]) -> tuple[int, list[int]]:
    """Block tables padded with the null block (0) to the longest, row after row."""
    width = max((len(table) for table in tables), default=0)
    flat: list[int] = []
    for table in tables:
        flat.extend(table)
        flat.extend([0] * (width - len(table)))
    return width, flat


def payload_length(header: list[int]) -> int:
    """How many int64 follow a STEP header."""
    _, tokens, decodes, decode_width, prefills, prefill_width, sampled, copies = header[:8]
    window, window_decode_width, window_prefill_width, window_copies = header[8:12]
    main = (3 * tokens + decodes * (decode_width + 1)
            + prefills * (prefill_width + 2) + 1 + sampled + 2 * copies)
    return main + window * (tokens + decodes * window_decode_width
                            + prefills * window_prefill_width + 2 * window_copies) + header[12] * tokens


def decode_step(header: list[int], payload: torch.Tensor) -> StepInputs:
    """Tensors on the payload's device; views of it where the dtype allows.

    The int32 fields (block tables, lengths, cu_seqlens) lie end to end in the
    payload, so they take one conversion, cut into views after it: at one
    stream a step is short and each small torch call, on caches the weights
    just streamed through, costs several microseconds (docs/performance.md)."""
    _, tokens, decodes, decode_width, prefills, prefill_width, sampled, copies = header[:8]
    window, window_decode_width, window_prefill_width, window_copies = header[8:12]
    ints = decodes * (decode_width + 1) + prefills * (prefill_width + 2) + 1
    sizes = [tokens, tokens, tokens, ints, sampled, 2 * copies]
    if window:
        sizes += [tokens, decodes * window_decode_width, prefills * window_prefill_width,
                  2 * window_copies]
    if header[12]:
        sizes.append(tokens)
    parts = torch.split_with_sizes(payload, sizes)
    input_ids, positions, slots, int_part, sample_rows, pairs = parts[:6]
    decode_tables, decode_lens, prefill_tables, cu_seqlens, prefill_lens = torch.split_with_sizes(
        int_part.to(torch.int32),
        [decodes * decode_width, decodes, prefills * prefill_width, prefills + 1, prefills])
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=decodes,
        decode_block_tables=decode_tables.view(decodes, decode_width),
        decode_context_lens=decode_lens,
        prefill_block_tables=prefill_tables.view(prefills, prefill_width),
        prefill_cu_seqlens_q=cu_seqlens,
        prefill_context_lens=prefill_lens,
    )
    sources = destinations = pairs  # empty when nothing is copied (the usual step)
    if copies:
        pairs = pairs.view(copies, 2)
        sources, destinations = pairs[:, 0], pairs[:, 1]
    inputs = StepInputs(input_ids, positions, meta, sample_rows, sources, destinations)
    if header[12]:
        inputs.lora_ids = parts[-1]
    if window:
        window_slots, window_decode, window_prefill, window_pairs = parts[6:10]
        meta.window = dataclasses.replace(
            meta, slot_mapping=window_slots,
            decode_block_tables=window_decode.view(decodes, window_decode_width).to(torch.int32),
            prefill_block_tables=window_prefill.view(prefills, window_prefill_width).to(torch.int32))
        inputs.window_copies = window_pairs.view(window_copies, 2)
    return inputs
