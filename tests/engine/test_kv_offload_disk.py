"""The disk tier on a real filesystem: exact LRU bookkeeping, namespaces, bad
files as misses, restart, and a disk that cannot be written (a real ENOSPC
from /dev/full, a folder under a regular file)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from engine.core.kv_offload import record
from engine.core.kv_offload.disk import DiskTier
from kv_records import NS, PAYLOAD, h, payload, rec

SIZE = record.record_size(NS, PAYLOAD)  # bytes of one record file


def put(tier: DiskTier, *names: str) -> None:
    for name in names:
        assert tier.store(h(name), rec(name, tier.namespace))


def path(tier: DiskTier, name: str) -> Path:
    return tier.folder / f"{h(name).hex()}.kv"


def stats(tier: DiskTier) -> dict[str, int]:
    return tier.snapshot()


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name == "engine.core.kv_offload.disk"]


def test_files_live_under_the_namespace_folder(tmp_path):
    tier = DiskTier(NS, tmp_path, 3 * SIZE)
    put(tier, "a")
    assert tier.folder == tmp_path / "model-a-16-bfloat16-h1"
    assert [p.name for p in tier.folder.iterdir()] == [f"{h('a').hex()}.kv"]
    assert path(tier, "a").read_bytes() == rec("a")
    assert bytes(tier.load(h("a"))) == payload("a")


def test_lru_order_and_exact_counters(tmp_path):
    tier = DiskTier(NS, tmp_path, 2 * SIZE)
    put(tier, "a", "b", "c")  # room for two: a goes
    assert not tier.contains(h("a")) and not path(tier, "a").exists()
    assert tier.load(h("a")) is None
    assert bytes(tier.load(h("b"))) == payload("b")  # b is now the most recently used
    assert bytes(tier.load(h("c"))) == payload("c")
    assert bytes(tier.load(h("b"))) == payload("b")
    put(tier, "d")  # c is the least recently used: it goes
    assert [tier.contains(h(n)) for n in "abcd"] == [False, True, False, True]
    assert sorted(p.name for p in tier.folder.iterdir()) == sorted(
        f"{h(n).hex()}.kv" for n in "bd")
    snap = stats(tier)
    assert snap["used_bytes"] == 2 * SIZE == snap["capacity_bytes"]
    assert {k: snap[k] for k in ("hits", "misses", "stores", "evictions", "bad_records",
                                 "errors", "bytes_loaded", "bytes_stored", "up")} == {
        "hits": 3, "misses": 1, "stores": 4, "evictions": 2, "bad_records": 0, "errors": 0,
        "bytes_loaded": 3 * PAYLOAD, "bytes_stored": 4 * SIZE, "up": 1}


def test_used_bytes_is_the_sum_and_never_exceeds_capacity(tmp_path):
    capacity = 3 * SIZE + SIZE // 2
    tier = DiskTier(NS, tmp_path, capacity)
    for i in range(10):
        put(tier, f"block {i}")
        on_disk = sum(p.stat().st_size for p in tier.folder.iterdir())
        assert tier.used_bytes == on_disk <= capacity
    assert tier.used_bytes == 3 * SIZE and stats(tier)["evictions"] == 7


def test_a_stored_hash_is_marked_used_not_rewritten(tmp_path):
    tier = DiskTier(NS, tmp_path, 2 * SIZE)
    put(tier, "a", "b")
    inode = path(tier, "a").stat().st_ino
    assert tier.store(h("a"), rec("a"))  # a becomes most recently used
    assert path(tier, "a").stat().st_ino == inode  # the same file, not a new one
    put(tier, "c")
    assert [tier.contains(h(n)) for n in "abc"] == [True, False, True]
    assert stats(tier)["stores"] == 4 and stats(tier)["bytes_stored"] == 4 * SIZE


def test_a_record_larger_than_the_capacity_is_refused(tmp_path):
    tier = DiskTier(NS, tmp_path, SIZE - 1)
    assert not tier.store(h("a"), rec("a"))
    assert list(tier.folder.iterdir()) == [] and stats(tier)["stores"] == 0


def test_namespaces_are_isolated(tmp_path):
    one = DiskTier(NS, tmp_path, 3 * SIZE)
    other = DiskTier("model-b:16:bfloat16:h1", tmp_path, 3 * SIZE)
    put(one, "a")
    put(other, "b")
    assert one.folder != other.folder
    assert not other.contains(h("a")) and other.load(h("a")) is None
    assert not one.contains(h("b")) and one.load(h("b")) is None
    assert bytes(one.load(h("a"))) == payload("a")
    assert bytes(other.load(h("b"))) == payload("b")
    # A file of the other namespace planted under ours fails the record's checks.
    (one.folder / path(other, "b").name).write_bytes(path(other, "b").read_bytes())
    assert DiskTier(NS, tmp_path, 3 * SIZE).load(h("b")) is None


def corrupt(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF  # a payload byte
    file.write_bytes(bytes(data))


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:-10])


def foreign(file: Path) -> None:
    """The record of another hash under this hash's name."""
    file.write_bytes(rec("other block"))


@pytest.mark.parametrize("damage", [corrupt, truncate, foreign])
def test_a_bad_file_is_a_miss_and_is_removed(tmp_path, damage):
    tier = DiskTier(NS, tmp_path, 3 * SIZE)
    put(tier, "a", "b")
    damage(path(tier, "a"))
    assert tier.load(h("a")) is None
    assert not path(tier, "a").exists() and not tier.contains(h("a"))
    snap = stats(tier)
    assert (snap["bad_records"], snap["misses"], snap["hits"]) == (1, 1, 0)
    assert snap["used_bytes"] == SIZE
    assert bytes(tier.load(h("b"))) == payload("b")


def test_a_file_removed_behind_its_back_is_a_miss(tmp_path):
    tier = DiskTier(NS, tmp_path, 3 * SIZE)
    put(tier, "a")
    path(tier, "a").unlink()
    assert tier.load(h("a")) is None
    assert not tier.contains(h("a")) and tier.used_bytes == 0
    assert stats(tier)["bad_records"] == 0 and stats(tier)["errors"] == 0


def test_a_restart_reindexes_oldest_first_and_removes_temp_files(tmp_path):
    first = DiskTier(NS, tmp_path, 3 * SIZE)
    put(first, "a", "b", "c")
    for age, name in enumerate("bca"):  # b oldest, then c, then a
        os.utime(path(first, name), ns=(10**9 * (age + 1),) * 2)
    stale = first.folder / f"{h('d').hex()}.12345.tmp"
    stale.write_bytes(rec("d")[:100])
    (first.folder / "notes.txt").write_text("not ours")  # foreign files are left alone
    first.close()

    second = DiskTier(NS, tmp_path, 3 * SIZE)
    assert not stale.exists() and (second.folder / "notes.txt").exists()
    assert second.used_bytes == 3 * SIZE
    assert [second.contains(h(n)) for n in "abc"] == [True, True, True]
    put(second, "d")  # b was the oldest
    assert [second.contains(h(n)) for n in "abcd"] == [True, False, True, True]
    assert bytes(second.load(h("c"))) == payload("c")


def test_a_restart_with_a_smaller_capacity_evicts_the_oldest(tmp_path):
    first = DiskTier(NS, tmp_path, 3 * SIZE)
    put(first, "a", "b", "c")
    for age, name in enumerate("cab"):
        os.utime(path(first, name), ns=(10**9 * (age + 1),) * 2)
    second = DiskTier(NS, tmp_path, 2 * SIZE)
    assert [second.contains(h(n)) for n in "abc"] == [True, True, False]
    assert not path(second, "c").exists()
    assert second.used_bytes == 2 * SIZE and stats(second)["evictions"] == 1


def test_a_hit_is_remembered_across_a_restart(tmp_path):
    first = DiskTier(NS, tmp_path, 2 * SIZE)
    put(first, "a", "b")
    for age, name in enumerate("ab"):
        os.utime(path(first, name), ns=(10**9 * (age + 1),) * 2)
    assert first.load(h("a")) is not None  # touches a: b is now the oldest file
    second = DiskTier(NS, tmp_path, 2 * SIZE)
    put(second, "c")
    assert [second.contains(h(n)) for n in "abc"] == [True, False, True]


def test_a_folder_that_cannot_be_made_disables_the_tier(tmp_path, caplog):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING):
        tier = DiskTier(NS, blocker / "kv", 3 * SIZE)
    assert not tier.enabled
    (message,) = warnings(caplog)
    assert str(blocker / "kv") in message
    assert not tier.store(h("a"), rec("a")) and tier.load(h("a")) is None
    assert not tier.contains(h("a")) and tier.leading_run([h("a")]) == 0
    snap = stats(tier)
    assert (snap["up"], snap["stores"], snap["misses"], snap["used_bytes"]) == (0, 0, 1, 0)
    assert len(warnings(caplog)) == 1


def test_a_full_disk_disables_the_tier_with_one_warning(tmp_path, caplog):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    tier = DiskTier(NS, tmp_path, 3 * SIZE)
    put(tier, "a")
    temp = tier.folder / f"{h('b').hex()}.{os.getpid()}.tmp"
    temp.symlink_to("/dev/full")  # the write of b lands on a device that is always full
    with caplog.at_level(logging.WARNING):
        assert not tier.store(h("b"), rec("b"))
        assert not tier.enabled
        (message,) = warnings(caplog)
        assert "No space left on device" in message and str(tier.folder) in message
        assert not tier.store(h("c"), rec("c"))
        assert not tier.contains(h("a")) and tier.load(h("a")) is None
    assert len(warnings(caplog)) == 1
    assert not temp.exists() and not path(tier, "b").exists()
    snap = stats(tier)
    assert (snap["up"], snap["stores"], snap["errors"], snap["used_bytes"]) == (0, 1, 1, SIZE)
