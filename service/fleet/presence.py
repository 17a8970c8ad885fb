"""Presence: each replica's heartbeat in Redis, and the fleet as Redis sees it.

    pagedserve:replica:<id>   STRING  JSON of ReplicaInfo, expires after 3 beats
    pagedserve:replicas       ZSET    replica id -> when its key expires (unix seconds)

A replica that dies stops beating and its key expires; readers drop ids
whose expiry has passed. `pagedserve fleet` prints both tables below.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import msgspec
import redis.asyncio as aioredis

from service.fleet.registry import KEY_ROOT, PrefixRegistry

REPLICAS_KEY = f"{KEY_ROOT}:replicas"
MISSED_BEATS = 3  # a replica is gone once this many heartbeats did not arrive


class ReplicaInfo(msgspec.Struct):
    id: str
    url: str
    model: str
    namespace: str  # the registry namespace of its untenanted requests
    status: str  # "warming", "ok", "draining", "dead"
    running: int
    waiting: int
    kv_usage: float  # fraction of KV blocks that requests hold
    warm_prefixes: list[str]  # ids of the registry prefixes it holds warm
    started: float
    updated: float


def replica_key(replica_id: str) -> str:
    return f"{KEY_ROOT}:replica:{replica_id}"


async def beat(client: aioredis.Redis, info: ReplicaInfo, period: float) -> None:
    """Publish this replica's state; it lapses unless renewed within MISSED_BEATS periods."""
    ttl = period * MISSED_BEATS
    async with client.pipeline(transaction=False) as pipe:  # closed on failure too
        pipe.set(replica_key(info.id), msgspec.json.encode(info), px=int(ttl * 1000))
        pipe.zadd(REPLICAS_KEY, {info.id: info.updated + ttl})
        await pipe.execute()


async def leave(client: aioredis.Redis, replica_id: str) -> None:
    """A clean exit: the fleet stops listing this replica at once."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.delete(replica_key(replica_id))
        pipe.zrem(REPLICAS_KEY, replica_id)
        await pipe.execute()


async def replicas(client: aioredis.Redis) -> list[ReplicaInfo]:
    """Live replicas, by id; lapsed ones are pruned from the index."""
    now = time.time()
    await client.zremrangebyscore(REPLICAS_KEY, "-inf", now)
    ids = [i.decode() for i in await client.zrange(REPLICAS_KEY, 0, -1)]
    if not ids:
        return []
    found = await client.mget([replica_key(i) for i in ids])
    return [msgspec.json.decode(raw, type=ReplicaInfo) for raw in found if raw is not None]


async def fleet_report(url: str, limit: int, half_life: float) -> str:
    """The fleet as text: live replicas, then each namespace's most popular prefixes."""
    from rich.console import Console
    from rich.table import Table

    from service.fleet.registry import connect

    client = connect(url)
    try:
        live = await replicas(client)
        registry = PrefixRegistry(client, half_life_seconds=half_life)
        namespaces = await registry.namespaces()
        tops = {key: await registry.top([key], limit) for key in namespaces}
    finally:
        await client.aclose()
    console = Console(record=True, width=140)
    table = Table(title=f"replicas ({len(live)})")
    for column in ("id", "url", "model", "status", "running", "waiting", "KV used",
                   "warm prefixes", "seen"):
        table.add_column(column)
    now = time.time()
    for r in live:
        table.add_row(r.id, r.url, r.model, r.status, str(r.running), str(r.waiting),
                      f"{r.kv_usage:.0%}", str(len(r.warm_prefixes)), f"{now - r.updated:.0f} s ago")
    console.print(table)
    for key, top in tops.items():
        table = Table(title=f"prefixes in {key}")
        for column in ("prefix", "tokens", "sightings", "popularity now", "last used"):
            table.add_column(column)
        for p in top:
            table.add_row(p.id[:16], str(len(p.token_ids)), str(p.seen),
                          f"{p.popularity(now, half_life):.2f}", f"{now - p.last_used:.0f} s ago")
        console.print(table)
    return console.export_text()



def main(argv: list[str] | None = None) -> int:
    """`pagedserve fleet`: print the fleet once."""
    parser = argparse.ArgumentParser(prog="pagedserve fleet",
                                     description="the fleet as its Redis sees it")
    parser.add_argument("--redis-url", required=True, help="redis:// or rediss:// URL")
    parser.add_argument("--top", type=int, default=10, help="prefixes shown per namespace")
    parser.add_argument("--half-life-seconds", type=float, default=3600.0,
                        help="the replicas' --registry-half-life-seconds, to show popularity")
    args = parser.parse_args(argv)
    from service.fleet.registry import REDIS_ERRORS

    try:
        text = asyncio.run(fleet_report(args.redis_url, args.top, args.half_life_seconds))
    except REDIS_ERRORS as exc:
        print(f"pagedserve fleet: cannot read {args.redis_url}: {exc}")
        return 1
    print(text, end="")
    return 0
