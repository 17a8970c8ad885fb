"""Token types (BERT's segment ids) carried inside the token ids.

A cross-encoder scores a pair as one sequence, ``[CLS] query [SEP] document [SEP]``,
and BERT adds a second embedding that says which half each token is in. Rather
than a second per-token list through the scheduler, the step encoding and the
runner, the type rides in the high bits of the token id (as vLLM does):

    carried id = token id + type << TOKEN_TYPE_SHIFT

Only an encoder's embedding layer reads them apart (`split`). Encoders take no
prefix-cache hits, so the carried ids never meet a block hash that could mix
them with plain ones; a model without token types never sees them (the
engine refuses token_type_ids for it).
"""

from __future__ import annotations

import torch

TOKEN_TYPE_SHIFT = 30  # vocabularies stay far below 2**30 ids


def carry(token_ids: list[int], token_type_ids: list[int] | None) -> list[int]:
    """The ids with each token's type in their high bits (unchanged without types)."""
    if not token_type_ids:
        return list(token_ids)
    return [t + (s << TOKEN_TYPE_SHIFT) for t, s in zip(token_ids, token_type_ids, strict=True)]


def split(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, token types) of carried ids."""
    return input_ids & ((1 << TOKEN_TYPE_SHIFT) - 1), input_ids >> TOKEN_TYPE_SHIFT
