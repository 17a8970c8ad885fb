"""Content hashes of full KV blocks, the keys of the prefix cache.

Block i of a sequence is identified by everything that determines its K/V:
the tokens before it (through its parent's hash), its own tokens, and extra
keys that change the numbers without changing the tokens:

    hash_0 = H(ROOT,   tokens[0:bs],   model fingerprint + cache salt)
    hash_1 = H(hash_0, tokens[bs:2bs], model fingerprint)
    hash_2 = H(hash_1, ...)

H is SHA-256 over a fixed byte layout, with a fixed root, so every process and
every replica computes the same hash for the same prefix (Python's hash() is
salted per process and would not do). The cache salt goes into the first
block only: it separates tenants' chains from the root, so two tenants never
share a block, and nobody can time a cache hit on someone else's prompt
(CVE-2025-46570).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = hashlib.sha256(b"pagedserve prefix cache v1").digest()


def hash_block(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    digest = hashlib.sha256(parent)
    digest.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    digest.update(struct.pack("<I", len(extra)))
    digest.update(extra)
    return digest.digest()

