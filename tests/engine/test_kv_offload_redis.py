"""The Redis tier against a real redis-server: round trip, one-round-trip
lookups, namespaces, the TTL, bad values as misses, the server going away
and coming back, and the capacity read from INFO memory."""

from __future__ import annotations

import logging
import time

import pytest
import redis

from engine.core.kv_offload import record
from engine.core.kv_offload.redis_tier import RedisTier
from kv_records import NS, PAYLOAD, h, payload, rec
from live_server import free_port
from need import need
from redis_server import RedisServer, redis_binary, start_redis

TTL = 60
LOGGER = "engine.core.kv_offload.redis_tier"


def key(name: str, namespace: str = NS) -> str:
    return f"pagedserve:kv:{namespace}:{h(name).hex()}"


def logged(caplog, level: int, containing: str = "") -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == level and r.name == LOGGER and containing in r.getMessage()]


def outages(caplog) -> list[str]:
    return logged(caplog, logging.WARNING, "unreachable")


@pytest.fixture
def server(tmp_path):
    server = start_redis(tmp_path)
    yield server
    server.kill()


@pytest.fixture
def raw(server):
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()


@pytest.fixture
def tier(server):
    tier = RedisTier(NS, server.url, TTL)
    yield tier
    tier.close()


def test_round_trip(tier, raw):
    assert tier.up and tier.capacity_bytes == 0
    assert not tier.contains(h("a")) and tier.load(h("a")) is None
    assert tier.store(h("a"), rec("a"))
    assert tier.contains(h("a"))
    assert bytes(tier.load(h("a"))) == payload("a")
    assert raw.get(key("a")) == rec("a")
    snap = tier.snapshot()
    assert {k: snap[k] for k in ("hits", "misses", "stores", "bad_records", "errors",
                                 "bytes_loaded", "bytes_stored", "up")} == {
        "hits": 1, "misses": 1, "stores": 1, "bad_records": 0, "errors": 0,
        "bytes_loaded": PAYLOAD, "bytes_stored": len(rec("a")), "up": 1}


def test_leading_run_counts_present_keys_from_the_first(tier, raw):
    for name in ("a", "b", "d"):
        assert tier.store(h(name), rec(name))
    hashes = [h(n) for n in "abcd"]
    before = raw.info("stats")["total_commands_processed"]
    assert tier.leading_run(hashes) == 2
    # One EXISTS per hash, in one pipeline (our INFO is the one other command).
    assert raw.info("stats")["total_commands_processed"] - before == len(hashes) + 1
    assert tier.leading_run([h("c"), h("a")]) == 0
    assert tier.leading_run([h("a"), h("b"), h("d")]) == 3
    assert tier.leading_run([]) == 0


def test_namespaces_are_isolated(server, tier):
    other = RedisTier("model-b:16:bfloat16:h1", server.url, TTL)
    try:
        assert tier.store(h("a"), rec("a"))
        assert other.store(h("b"), rec("b", other.namespace))
        assert not other.contains(h("a")) and other.load(h("a")) is None
        assert not tier.contains(h("b")) and tier.load(h("b")) is None
        assert other.leading_run([h("a")]) == 0
        assert bytes(other.load(h("b"))) == payload("b")
    finally:
        other.close()


def test_every_value_has_the_ttl(tier, raw):
    assert tier.store(h("a"), rec("a"))
    assert 0 < raw.ttl(key("a")) <= TTL


@pytest.mark.parametrize("bad", [
    rec("a")[:-10],  # cut short
    rec("a")[:20],  # shorter than the header
    rec("b"),  # another block's record under a's key
    rec("a", "model-b:16:bfloat16:h1"),  # another model's
])
def test_a_bad_value_is_a_miss_and_is_deleted(tier, raw, bad):
    raw.set(key("a"), bad)
    assert tier.contains(h("a"))  # EXISTS cannot tell; the load checks
    assert tier.load(h("a")) is None
    assert not raw.exists(key("a"))
    snap = tier.snapshot()
    assert (snap["bad_records"], snap["misses"], snap["hits"], snap["errors"]) == (1, 1, 0, 0)
    assert tier.up


def timed(call):
    start = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start


def test_redis_going_away_and_coming_back(server, tier, caplog):
    assert tier.store(h("a"), rec("a"))
    server.kill()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(3):
            for call, miss in [(lambda: tier.contains(h("a")), False),
                               (lambda: tier.leading_run([h("a")]), 0),
                               (lambda: tier.load(h("a")), None),
                               (lambda: tier.store(h("b"), rec("b")), False),
                               (tier.refresh, None)]:
                result, seconds = timed(call)
                assert result == miss and seconds < 0.1
        assert not tier.up and tier.snapshot()["up"] == 0
        (warning,) = outages(caplog)
        assert "redis tier unreachable" in warning and "miss until it answers" in warning
        assert "Connection" in warning

        server.start()
        deadline = time.monotonic() + 15  # the longest backoff is 10 s
        while not tier.up and time.monotonic() < deadline:
            tier.refresh()
            time.sleep(0.05)
        assert tier.up and tier.snapshot()["up"] == 1
        assert len(logged(caplog, logging.INFO)) == 1
    assert tier.store(h("b"), rec("b"))  # a new server: a is gone, b is kept
    assert bytes(tier.load(h("b"))) == payload("b")
    assert tier.leading_run([h("b"), h("a")]) == 1
    assert len(outages(caplog)) == 1


def test_a_tier_whose_redis_is_not_there_starts_down(caplog):
    url = f"redis://127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        tier, seconds = timed(lambda: RedisTier(NS, url, TTL))
    try:
        assert not tier.up and seconds < 1.0
        assert len(logged(caplog, logging.WARNING)) == 1
        errors = tier.snapshot()["errors"]
        tier.refresh()  # within the first backoff: no PING
        assert tier.snapshot()["errors"] == errors
        time.sleep(0.3)
        tier.refresh()  # the backoff allows a PING, which fails: no second warning
        assert tier.snapshot()["errors"] == errors + 1 and not tier.up
        assert len(logged(caplog, logging.WARNING)) == 1
    finally:
        tier.close()


def test_capacity_comes_from_maxmemory(tmp_path, caplog):
    need(redis_binary() is not None, "redis-server is not installed (apt-get install redis-server)")
    server = RedisServer(tmp_path, extra_args=["--maxmemory", "4mb",
                                               "--maxmemory-policy", "volatile-lru"]).start()
    tier = RedisTier(NS, server.url, TTL)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            tier.refresh()
        assert tier.capacity_bytes == 4 * 1024 * 1024 and tier.used_bytes > 0
        assert tier.snapshot()["capacity_bytes"] == 4 * 1024 * 1024
        assert logged(caplog, logging.WARNING) == []
        too_big = record.encode(NS, h("big"), bytes(5 * 1024 * 1024))
        assert not tier.store(h("big"), too_big)  # refused before the network
        assert tier.up and tier.snapshot()["errors"] == 0
    finally:
        tier.close()
        server.kill()


def test_no_maxmemory_warns_once_and_bounds_no_size(tier, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        tier.refresh()
        tier._info_at = 0.0  # make the next refresh read INFO again
        tier.refresh()
    (warning,) = logged(caplog, logging.WARNING)
    assert "maxmemory" in warning and "volatile-lru" in warning
    assert tier.capacity_bytes == 0 and tier.used_bytes > 0
    big = record.encode(NS, h("big"), bytes(2 * 1024 * 1024))
    assert tier.store(h("big"), big)
    assert tier.load(h("big")).nbytes == 2 * 1024 * 1024


def test_load_many_is_one_round_trip_with_the_same_checks(tier, raw):
    """A prompt's blocks come in one MGET; a bad value among them is a miss, and deleted."""
    for name in ("a", "b", "c"):
        tier.store(h(name), rec(name))
    raw.set(key("b"), rec("b")[:-10])  # truncated
    before = raw.info("commandstats").get("cmdstat_mget", {}).get("calls", 0)
    loaded = tier.load_many([h("a"), h("b"), h("c"), h("d")])
    assert raw.info("commandstats")["cmdstat_mget"]["calls"] == before + 1
    assert [None if p is None else bytes(p) for p in loaded] == \
        [payload("a"), None, payload("c"), None]
    assert (tier.stats.hits, tier.stats.misses, tier.stats.bad_records) == (2, 2, 1)
    assert raw.exists(key("b")) == 0
