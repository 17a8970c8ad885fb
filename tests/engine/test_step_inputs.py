"""A step's encoding (what tensor-parallel rank 0 broadcasts) decodes to the exact tensors."""

from __future__ import annotations

import torch

from engine.core.scheduler import ScheduledSequence
from engine.model.step_inputs import HEADER_LEN, Op, decode_step, encode_step, payload_length


def seq(seq_id: int, tokens: list[int], start: int, table: list[int]) -> ScheduledSequence:
    return ScheduledSequence(seq_id, tokens, start, table, None, None, [], [])


def test_decodes_and_prefills_round_trip():
    block_size = 4
    decodes = [seq(0, [11], 9, [3, 7, 5]), seq(1, [12], 2, [8])]
    prefills = [seq(2, [20, 21, 22], 0, [9]), seq(3, [30, 31], 5, [4, 6])]
    header, payload = encode_step(decodes, prefills, sample_rows=[0, 1, 6],
                                  copies=[(5, 10)], block_size=block_size)
    assert header == [Op.STEP, 7, 2, 3, 2, 2, 3, 1]
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
