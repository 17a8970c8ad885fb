"""The byte layout of one offloaded KV block, and the checks that make a bad copy a miss.

Every tier stores the same record for a block: a fixed header, then the
block's K and V for all layers, contiguous (one value per block, whatever
the number of layers: vLLM found that per-layer units of 8-72 KB cost 4x the
TTFT of one 0.5-2 MB unit).

    offset  size  field
    0       4     magic  b"PSKV"
    4       2     record version (1)
    6       2     length of the namespace that follows the header
    8       32    block hash (the prefix-cache key, engine/core/block_hash.py)
    40      8     payload length in bytes
    48      4     CRC-32 of the payload
    52      4     reserved (0)
    56      n     namespace (utf-8): model fingerprint, block size, KV cache dtype, hash scheme
    56+n    ...   payload: [2 (K, V), layers, block_size, kv_heads, head_dim] in the KV
                  cache's dtype (int8: rows of head_dim codes + an fp16 scale,
                  kernels/kv_quant.py)

`decode` returns the payload only when the magic, version, namespace, hash,
length and checksum all agree; anything else (a corrupt or truncated file, a
value cut short, an entry of another model or another block) is a miss. A
wrong block would silently change what the model generates; a miss only
costs a recomputation.
"""

from __future__ import annotations

import struct
import zlib

MAGIC = b"PSKV"
VERSION = 1
HEADER = struct.Struct("<4sHH32sQII")  # magic, version, namespace length, hash, length, crc, 0
HASH_BYTES = 32


def record_size(namespace: str, payload_bytes: int) -> int:
    """Bytes of the record of one block (header + namespace + payload)."""
    return HEADER.size + len(namespace.encode()) + payload_bytes


def encode(namespace: str, block_hash: bytes, payload) -> bytes:
    """The record of one block; `payload` is any bytes-like object."""
    if len(block_hash) != HASH_BYTES:
        raise ValueError(f"a block hash has {HASH_BYTES} bytes, got {len(block_hash)}")
    space = namespace.encode()
    payload = memoryview(payload).cast("B")
    header = HEADER.pack(MAGIC, VERSION, len(space), block_hash, payload.nbytes,
                         zlib.crc32(payload), 0)
    return b"".join((header, space, payload))


def decode(namespace: str, block_hash: bytes, record) -> memoryview | None:
    """The payload of `record` if it is a sound copy of `block_hash` in `namespace`, else None."""
    view = memoryview(record).cast("B")
    if view.nbytes < HEADER.size:
        return None
    magic, version, space_len, stored_hash, length, crc, _ = HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION or stored_hash != block_hash:
        return None
    start = HEADER.size + space_len
    if view[HEADER.size:start].tobytes() != namespace.encode() or view.nbytes != start + length:
        return None
    payload = view[start:]
    return payload if zlib.crc32(payload) == crc else None
