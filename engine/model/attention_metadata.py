"""How the flat token batch of one step maps onto sequences and KV-cache slots.

The runner builds it once per step (model/step_inputs.py) and every attention
layer reads it. Decodes come first, one row each, then the prefill chunks:

    rows:   | d0 | d1 | d2 |  p0 p0 p0 p0 p0  |  p1 p1 p1 |
             decode_*          prefill_* (cu_seqlens_q = [0, 5, 8])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """How the flat token batch maps onto sequences and KV-cache slots."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    num_decode_tokens: int  # the first num_decode_tokens rows are decodes, one per sequence
    decode_block_tables: torch.Tensor  # int32 [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor  # int32 [num_decodes]
    prefill_block_tables: torch.Tensor  # int32 [num_prefills, max_blocks]
    prefill_cu_seqlens_q: torch.Tensor  # int32 [num_prefills + 1]
    prefill_context_lens: torch.Tensor  # int32 [num_prefills]
    # The sliding layers' view of the same batch in a model whose sliding layers
    # have their own KV pool (engine/core/hybrid_blocks.py): other slots and
    # block tables, the same lengths. None: every layer reads the fields above.
    window: AttentionMetadata | None = None
