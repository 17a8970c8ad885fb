"""The prefix registry against a real Redis server: round trip, namespaces,
popularity with decay, the seen-twice rule, bounds, and Redis going away."""

from __future__ import annotations

import gc
import hashlib
import logging
import random
from types import SimpleNamespace

import pytest

from engine.core.block_hash import prefix_hashes
from redis_server import start_redis
from service.fleet.presence import ReplicaInfo, beat, leave
from service.fleet.registry import REDIS_ERRORS, Namespace, PrefixRegistry, connect, salt_id

FP = hashlib.sha256(b"model A").digest()
NS = Namespace(FP, 4, "bfloat16")
HOUR = 3600.0


@pytest.fixture
def redis_server(tmp_path):
    server = start_redis(tmp_path)
    yield server
    server.kill()


def prefix(seed: int, blocks: int = 3, namespace: Namespace = NS):
    rng = random.Random(seed)
    tokens = [rng.randrange(50_000) for _ in range(blocks * namespace.block_size)]
    return tokens, prefix_hashes(tokens, namespace.block_size, namespace.fingerprint)


def registry(server, **kw) -> PrefixRegistry:
    return PrefixRegistry(connect(server.url), **kw)


async def record(reg, namespace, seed, times, blocks=3):
    tokens, hashes = prefix(seed, blocks, namespace)
    for t in times:
        reg.record(namespace, tokens, hashes, now=t)
    await reg.flush()
    return tokens, hashes


@pytest.mark.asyncio
async def test_round_trip_after_the_second_sighting(redis_server):
    reg = registry(redis_server)
    tokens, hashes = await record(reg, NS, 1, [1000.0])
    assert await reg.top([NS.key], 10) == []  # seen once: a candidate, no tokens stored
    await record(reg, NS, 1, [1010.0])
    (kept,) = await reg.top([NS.key], 10)
    assert (kept.token_ids, kept.block_hashes, kept.seen) == (tokens, hashes, 2)
    assert kept.last_used == 1010.0 and kept.id == hashes[-1].hex()
    assert kept.namespace == NS.key
    assert reg.redis_up and reg.recorded == 2 and reg.dropped == 0
    assert await reg.namespaces() == [NS.key]


@pytest.mark.asyncio
async def test_min_seen_is_a_setting(redis_server):
    once = registry(redis_server, min_seen=1)
    await record(once, NS, 2, [5.0])
    assert len(await once.top([NS.key], 10)) == 1
    thrice = registry(redis_server, min_seen=3)
    await record(thrice, NS, 3, [5.0, 6.0])
    assert [p.seen for p in await thrice.top([NS.key], 10)] == [1]  # only seed 2's
    await record(thrice, NS, 3, [7.0])
    assert sorted(p.seen for p in await thrice.top([NS.key], 10)) == [1, 3]


@pytest.mark.asyncio
@pytest.mark.parametrize("other", [
    Namespace(hashlib.sha256(b"model B").digest(), 4, "bfloat16"),
    Namespace(FP, 16, "bfloat16"),
    Namespace(FP, 4, "float32"),
    Namespace(FP, 4, "int8"),  # --kv-cache-dtype int8: another block layout
    Namespace(FP, 4, "bfloat16", salt_id=salt_id(b"tenant")),
    Namespace(FP, 4, "bfloat16", scheme=2),
])
async def test_namespaces_are_isolated(redis_server, other):
    reg = registry(redis_server)
    await record(reg, NS, 4, [1.0, 2.0])
    assert await reg.top([other.key], 10) == []
    tokens, _ = await record(reg, other, 5, [1.0, 2.0])
    assert [p.token_ids for p in await reg.top([other.key], 10)] == [tokens]
    assert len(await reg.top([NS.key], 10)) == 1
    assert len(await reg.top([NS.key, other.key], 10)) == 2


def test_a_replica_keys_its_prefixes_by_its_kv_cache_dtype():
    """Replicas of one model in one dtype, one with an int8 KV cache: their
    registries are apart, so neither warms the other's blocks."""
    from service.fleet.replica import namespace

    def state(kv_cache_dtype: str) -> SimpleNamespace:
        engine = SimpleNamespace(fingerprint=FP, config=SimpleNamespace(block_size=4),
                                 dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
        return SimpleNamespace(engine=engine)

    assert namespace(state("int8"), None) == Namespace(FP, 4, "int8")
    assert namespace(state("int8"), None).key != namespace(state("bfloat16"), None).key


@pytest.mark.asyncio
async def test_popularity_decays_with_the_half_life(redis_server):
    """Old fame fades: 8 sightings 10 half-lives ago weigh less than 2 today."""
    reg = registry(redis_server, half_life_seconds=HOUR)
    old, _ = await record(reg, NS, 6, [0.0 + i for i in range(8)])
    new, _ = await record(reg, NS, 7, [10 * HOUR, 10 * HOUR + 1])
    mid, _ = await record(reg, NS, 8, [9 * HOUR, 9 * HOUR + 1, 9 * HOUR + 2])
    ranked = await reg.top([NS.key], 10)
    assert [p.token_ids for p in ranked] == [new, mid, old]
    now = 10 * HOUR + 1
    assert ranked[0].popularity(now, HOUR) == pytest.approx(2.0, rel=1e-3)
    assert ranked[1].popularity(now, HOUR) == pytest.approx(1.5, rel=1e-3)
    assert ranked[2].popularity(now, HOUR) == pytest.approx(8 / 1024, rel=1e-2)
    assert [p.token_ids for p in await reg.top([NS.key], 2)] == [new, mid]


@pytest.mark.asyncio
async def test_decay_works_at_real_unix_times_without_overflow(redis_server):
    reg = registry(redis_server, half_life_seconds=1.0)  # t/h ~ 1.8e9: only the log is safe
    now = 1.8e9
    a, _ = await record(reg, NS, 9, [now, now + 1, now + 2])
    b, _ = await record(reg, NS, 10, [now + 3, now + 3.5])
    assert [p.token_ids for p in await reg.top([NS.key], 5)] == [b, a]


@pytest.mark.asyncio
async def test_kept_prefixes_are_bounded_least_popular_out(redis_server):
    reg = registry(redis_server, max_prefixes=2)
    await record(reg, NS, 11, [1.0, 2.0])
    b, _ = await record(reg, NS, 12, [3.0, 4.0, 5.0])
    c, _ = await record(reg, NS, 13, [6.0, 7.0, 8.0, 9.0])
    assert [p.token_ids for p in await reg.top([NS.key], 10)] == [c, b]
    keys = [key.decode() for key in await reg.client.keys(f"{NS.key}:p:*")]
    assert len(keys) == 2  # the dropped prefix's tokens went with it


@pytest.mark.asyncio
async def test_record_refuses_partial_blocks(redis_server):
    reg = registry(redis_server)
    tokens, hashes = prefix(14)
    with pytest.raises(ValueError):
        reg.record(NS, tokens[:-1], hashes)
    with pytest.raises(ValueError):
        reg.record(NS, [], [])


@pytest.mark.asyncio
async def test_redis_down_buffers_within_the_bound_then_catches_up(redis_server):
    reg = registry(redis_server, buffer_size=3)
    assert await reg.ping() and reg.redis_up
    redis_server.kill()
    assert not await reg.ping() and not reg.redis_up
    tokens, hashes = prefix(15)
    for t in range(5):
        reg.record(NS, tokens, hashes, now=float(t))
    assert reg.buffered == 3 and reg.dropped == 2
    with pytest.raises(Exception):
        await reg.flush()
    assert reg.buffered == 3 and not reg.redis_up  # nothing lost by the failed attempt
    redis_server.start()
    await reg.flush()
    assert reg.redis_up and reg.buffered == 0
    (kept,) = await reg.top([NS.key], 10)
    assert kept.seen == 3 and kept.token_ids == tokens


@pytest.mark.asyncio
async def test_redis_killed_mid_use_leaves_no_pipeline_unclosed(redis_server, caplog):
    """Every pipeline gives its connection back on the failure path: a dropped one
    is reported by redis-py as asyncio's "ERROR Unclosed Pipeline client"."""
    caplog.set_level(logging.WARNING)
    reg = registry(redis_server)
    tokens, hashes = prefix(21)
    await record(reg, NS, 21, [1.0])  # the script is loaded, a connection pooled
    info = ReplicaInfo("A", "http://a", "m", NS.key, "ok", 0, 0, 0.0, [], 1.0, 1.0)
    await beat(reg.client, info, 1.0)
    redis_server.kill()
    reg.record(NS, tokens, hashes, now=2.0)
    for attempt in (reg.flush, lambda: reg.top([NS.key], 3), reg.namespaces,
                    lambda: beat(reg.client, info, 1.0), lambda: leave(reg.client, "A")):
        with pytest.raises(REDIS_ERRORS):
            await attempt()
    gc.collect()  # in the loop, where a dropped pipeline reports itself
    assert [r.getMessage() for r in caplog.records if "Unclosed" in r.getMessage()] == []


@pytest.mark.asyncio
@pytest.mark.parametrize("tls", [False, True], ids=["redis", "rediss"])
async def test_password_protected_redis(tmp_path, tls):
    server = start_redis(tmp_path, password="s3cret", tls=tls)
    assert server.url.startswith("rediss://" if tls else "redis://")
    try:
        reg = registry(server)
        await record(reg, NS, 16, [1.0, 2.0])
        assert len(await reg.top([NS.key], 10)) == 1
        wrong = PrefixRegistry(connect(server.url.replace("s3cret", "wrong")))
        assert not await wrong.ping()
    finally:
        server.kill()
