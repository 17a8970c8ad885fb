"""Small block records for the offload tier tests: a hash, a payload and a record per name."""

from __future__ import annotations

import hashlib

from engine.core.kv_offload import record

NS = "model-a:16:bfloat16:h1"
PAYLOAD = 1000


def h(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def payload(name: str) -> bytes:
    return (name.encode() * PAYLOAD)[:PAYLOAD]


def rec(name: str, namespace: str = NS) -> bytes:
    return record.encode(namespace, h(name), payload(name))
