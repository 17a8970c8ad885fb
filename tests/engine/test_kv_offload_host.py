"""The host-memory tier and the block record, exactly: slots, LRU order, byte bounds, checks."""

from __future__ import annotations


import pytest

from engine.core.kv_offload import record
from engine.core.kv_offload.host import HostTier
from kv_records import NS, PAYLOAD, h, payload, rec

RECORD = record.record_size(NS, PAYLOAD)


def names(tier: HostTier) -> list[str]:
    """The tier's blocks, least recently used first."""
    by_hash = {h(n): n for n in "abcdefgh"}
    return [by_hash[block_hash] for block_hash in tier.index]


def test_record_round_trip_and_every_check():
    good = rec("a")
    assert bytes(record.decode(NS, h("a"), good)) == payload("a")
    assert len(good) == RECORD
    flipped = bytearray(good)
    flipped[-1] ^= 1
    assert record.decode(NS, h("a"), bytes(flipped)) is None  # checksum
    assert record.decode(NS, h("a"), good[:-1]) is None  # truncated
    assert record.decode(NS, h("a"), good + b"x") is None  # too long
    assert record.decode(NS, h("a"), good[:10]) is None  # not even a header
    assert record.decode(NS, h("b"), good) is None  # another block's
    assert record.decode("model-b:16:bfloat16:h1", h("a"), good) is None  # another model's
    assert record.decode("model-a:16:int8:h1", h("a"), good) is None  # another cache dtype's
    assert record.decode(NS, h("a"), b"XXXX" + good[4:]) is None  # not a record
    with pytest.raises(ValueError):
        record.encode(NS, b"short", payload("a"))


def test_slots_lru_order_and_byte_bound():
    tier = HostTier(NS, 3 * RECORD + RECORD // 2, RECORD)
    assert tier.num_slots == 3 and tier.capacity_bytes == 3 * RECORD
    for name in "abc":
        assert tier.store(h(name), rec(name))
    assert names(tier) == ["a", "b", "c"] and tier.used_bytes == 3 * RECORD
    assert bytes(tier.load(h("a"))) == payload("a")  # a is now the most recent
    assert names(tier) == ["b", "c", "a"]
    assert tier.store(h("d"), rec("d"))  # evicts b, the least recently used
    assert names(tier) == ["c", "a", "d"]
    assert tier.index[h("d")] == 1  # b's slot, reused
    assert tier.load(h("b")) is None
    assert tier.store(h("c"), rec("c"))  # already there: only marked used
    assert names(tier) == ["a", "d", "c"]
    assert tier.used_bytes == 3 * RECORD <= tier.capacity_bytes
    snap = tier.snapshot()
    assert (snap["hits"], snap["misses"], snap["stores"], snap["evictions"]) == (1, 1, 5, 1)
    assert snap["bytes_loaded"] == PAYLOAD and snap["bytes_stored"] == 5 * RECORD


def test_a_record_of_another_size_is_refused():
    tier = HostTier(NS, 2 * RECORD, RECORD)
    assert not tier.store(h("a"), rec("a") + b"x")
    assert not tier.store(h("a"), record.encode(NS, h("a"), b"short"))
    assert tier.used_bytes == 0


def test_namespaces_are_isolated():
    """A record of another namespace in a slot is a miss, never another model's K/V."""
    other_ns = "model-b:16:bfloat16:h1"  # as long as NS: its records fit the same slots
    tier = HostTier(NS, 2 * RECORD, RECORD)
    assert tier.store(h("a"), rec("a", other_ns))
    assert tier.load(h("a")) is None
    assert tier.stats.bad_records == 1
    other = HostTier(other_ns, 2 * RECORD, RECORD)
    assert other.store(h("a"), rec("a", other_ns))
    assert bytes(other.load(h("a"))) == payload("a")


def test_a_damaged_slot_is_a_miss_and_freed():
    tier = HostTier(NS, 2 * RECORD, RECORD)
    tier.store(h("a"), rec("a"))
    tier.pool[tier.index[h("a")], -1] ^= 0xFF
    assert tier.load(h("a")) is None
    assert tier.stats.bad_records == 1 and not tier.contains(h("a")) and tier.used_bytes == 0


def test_an_empty_budget_holds_nothing():
    tier = HostTier(NS, RECORD - 1, RECORD)
    assert tier.num_slots == 0 and not tier.store(h("a"), rec("a"))
