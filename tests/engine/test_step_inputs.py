"""A step's encoding (what tensor-parallel rank 0 broadcasts) decodes to the exact tensors."""

from __future__ import annotations

import torch

from engine.core.scheduler import ScheduledSequence
from engine.model.step_inputs import HEADER_LEN, Op, decode_step, encode_step, payload_length


def seq(seq_id: int, tokens: list[int], start: int, table: list[int],
        window_table: list[int] | None = None) -> ScheduledSequence:
    return ScheduledSequence(seq_id, tokens, start, table, None, None, [], [],
                             window_block_table=window_table)


def test_decodes_and_prefills_round_trip():
    block_size = 4
    decodes = [seq(0, [11], 9, [3, 7, 5]), seq(1, [12], 2, [8])]
    prefills = [seq(2, [20, 21, 22], 0, [9]), seq(3, [30, 31], 5, [4, 6])]
    header, payload = encode_step(decodes, prefills, sample_rows=[0, 1, 6],
                                  copies=[(5, 10)], block_size=block_size)
    assert header == [Op.STEP, 7, 2, 3, 2, 2, 3, 1, 0, 0, 0, 0, 0]  # no window group, no adapters
    assert len(header) == HEADER_LEN
    assert payload.dtype == torch.long and payload.numel() == payload_length(header)

    inputs = decode_step(header, payload)
    assert inputs.input_ids.tolist() == [11, 12, 20, 21, 22, 30, 31]
    assert inputs.positions.tolist() == [9, 2, 0, 1, 2, 5, 6]
    # position p of a sequence lives in slot table[p // 4] * 4 + p % 4
    assert inputs.meta.slot_mapping.tolist() == [5 * 4 + 1, 8 * 4 + 2, 36, 37, 38, 6 * 4 + 1, 6 * 4 + 2]
    meta = inputs.meta
    assert meta.num_decode_tokens == 2
    assert meta.decode_block_tables.tolist() == [[3, 7, 5], [8, 0, 0]]  # padded with block 0
    assert meta.decode_block_tables.dtype == torch.int32
    assert meta.decode_context_lens.tolist() == [10, 3]
    assert meta.prefill_block_tables.tolist() == [[9, 0], [4, 6]]
    assert meta.prefill_cu_seqlens_q.tolist() == [0, 3, 5]
    assert meta.prefill_context_lens.tolist() == [3, 7]
    assert inputs.sample_rows.tolist() == [0, 1, 6]
    assert inputs.copy_sources.tolist() == [5] and inputs.copy_destinations.tolist() == [10]


def test_an_empty_group_decodes_to_empty_tables():
    header, payload = encode_step([seq(0, [1], 0, [2])], [], [0], [], block_size=16)
    inputs = decode_step(header, payload)
    assert inputs.meta.prefill_block_tables.shape == (0, 0)
    assert inputs.meta.prefill_cu_seqlens_q.tolist() == [0]
    assert inputs.copy_sources.numel() == 0


def test_the_window_group_has_its_own_slots_tables_and_copies():
    """A hybrid model's sliding layers read other blocks for the same tokens
    (engine/core/hybrid_blocks.py): same lengths, their own tables and copies."""
    decodes = [seq(0, [11], 9, [3, 7, 5], [0, 2, 4])]  # block 0 left the window
    prefills = [seq(1, [20, 21], 4, [9, 6], [1, 8])]
    header, payload = encode_step(decodes, prefills, [0, 2], [(5, 10)], block_size=4,
                                  window_copies=[(4, 3), (8, 7)])
    assert header[8:] == [1, 3, 2, 2, 0]
    assert payload.numel() == payload_length(header)
    inputs = decode_step(header, payload)
    main, window = inputs.meta, inputs.meta.window
    assert main.slot_mapping.tolist() == [5 * 4 + 1, 6 * 4, 6 * 4 + 1]
    assert window.slot_mapping.tolist() == [4 * 4 + 1, 8 * 4, 8 * 4 + 1]
    assert window.decode_block_tables.tolist() == [[0, 2, 4]]
    assert window.prefill_block_tables.tolist() == [[1, 8]]
    assert window.decode_context_lens.tolist() == main.decode_context_lens.tolist() == [10]
    assert window.prefill_cu_seqlens_q.tolist() == [0, 2]
    assert window.window is None and window.num_decode_tokens == 1
    assert inputs.window_copies.tolist() == [[4, 3], [8, 7]]
    assert inputs.copy_sources.tolist() == [5]
