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

# Bump both together whenever the byte layout below changes: the fleet keys
# its shared registry by this version, so replicas of different versions
# never exchange hashes they would compute differently.
HASH_SCHEME_VERSION = 1
ROOT_HASH = hashlib.sha256(b"pagedserve prefix cache v1").digest()


def hash_block(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    digest = hashlib.sha256(parent)
    digest.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    digest.update(struct.pack("<I", len(extra)))
    digest.update(extra)
    return digest.digest()


def cache_namespace(fingerprint: bytes, block_size: int, kv_cache_dtype: str,
                    scheme: int = HASH_SCHEME_VERSION) -> str:
    """What two processes must share for one's cached K/V to fit the other:
    the model fingerprint (weights, dtype, quantization), the block size, the
    KV cache's dtype (--kv-cache-dtype: an int8 block's bytes are not a float
    block's) and this hash scheme. The fleet's registry and the shared KV tiers
    key everything they store by it."""
    return f"{fingerprint.hex()[:16]}:{block_size}:{kv_cache_dtype}:h{scheme}"


def salt_digest(cache_salt: str | None) -> bytes:
    """The bytes a tenant's cache salt adds to its first block (none: no salt)."""
    return hashlib.sha256(cache_salt.encode()).digest() if cache_salt else b""


def block_extra(index: int, extra: bytes, salt: bytes) -> bytes:
    """The extra keys of block `index`: the salt goes into the first block only."""
    return extra + salt if index == 0 else extra


def prefix_hashes(
    token_ids: Sequence[int], block_size: int, extra: bytes = b"", salt: bytes = b""
) -> list[bytes]:
    """The chained hashes of the full blocks of `token_ids`, as a sequence computes them."""
    hashes: list[bytes] = []
    parent = ROOT_HASH
    for i in range(len(token_ids) // block_size):
        tokens = token_ids[i * block_size:(i + 1) * block_size]
        parent = hash_block(parent, tokens, block_extra(i, extra, salt))
        hashes.append(parent)
    return hashes
