"""The Redis tier: block records shared by the whole fleet, under a TTL.

    pagedserve:kv:<namespace>:<block hash hex>   STRING  the record (record.py), EX ttl

The namespace (model fingerprint, block size, KV cache dtype, hash scheme) is in the
key, so replicas of different models share one Redis without ever reading
each other's blocks; the record's own checks catch anything else.

Bounded by Redis, not by us: every key has a TTL, and a server with
`maxmemory` and `maxmemory-policy volatile-lru` evicts the least recently
used keys that have one. `refresh()` reads `INFO memory` for the stats
(used_memory, maxmemory); a capacity of 0 means "no maxmemory", and then
the base class refuses no record for its size.

Synchronous redis-py, never on the engine thread: the offload manager asks
the tier from its worker threads (`present` on the look-up thread, `load_many`
and `store` on the load and store threads; engine/core/kv_offload/lookup.py);
the client's connection pool is thread-safe. It fails fast (connect 0.25 s,
reply 0.5 s, redis-py's own retries off): a cache lookup that waits costs
more than the recomputation it would save.

Up and down. The first failure marks the tier down with one warning; while
down every call answers a miss at once, without the network, so an outage
costs the engine nothing. `refresh()`, called by the offload manager's store
worker every second or so, PINGs with backoff (0.25 s doubling to 10 s) and
brings the tier back up with one info line.
"""

from __future__ import annotations

import logging
import time

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from engine.core.kv_offload import record
from engine.core.kv_offload.tier import Tier

logger = logging.getLogger(__name__)

KEY_ROOT = "pagedserve:kv"
CONNECT_TIMEOUT_SECONDS = 0.25
REPLY_TIMEOUT_SECONDS = 0.5
BACKOFF_SECONDS = (0.25, 10.0)  # first and longest wait between PINGs while down
INFO_INTERVAL_SECONDS = 5.0  # how often refresh() reads INFO memory while up

# What a lost or refused connection raises: redis-py's errors and the socket's.
REDIS_ERRORS = (RedisError, OSError)


class RedisTier(Tier):
    name = "redis"
    remote = True  # shared by the fleet: the offload manager refreshes it and re-sends by TTL

    def __init__(self, namespace: str, url: str, ttl_seconds: int) -> None:
        super().__init__(namespace, 0)  # 0: no bound of ours until INFO says maxmemory
        self.ttl_seconds = ttl_seconds
        self.key_prefix = f"{KEY_ROOT}:{namespace}:"
        self.client = redis.Redis.from_url(
            url, socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
            socket_timeout=REPLY_TIMEOUT_SECONDS, retry=Retry(NoBackoff(), 0),
            retry_on_error=[],
        )
        kwargs = self.client.connection_pool.connection_kwargs
        self.where = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}"
        self.up = True  # the latest command's outcome
        self._used = 0  # used_memory of the server, from INFO
        self._backoff = BACKOFF_SECONDS[0]
        self._retry_at = 0.0  # monotonic time of the next PING while down
        self._info_at = 0.0  # monotonic time of the next INFO read while up
        self._warned_unbounded = False
        try:
            self.client.ping()
        except REDIS_ERRORS as exc:
            self._failed(exc)

    def key(self, block_hash: bytes) -> str:
        return f"{self.key_prefix}{block_hash.hex()}"

    # -- what the offload manager calls ------------------------------------------------
    def present(self, block_hashes: list[bytes]) -> list[bool]:
        """Whether Redis holds each of `block_hashes`: one pipelined round trip."""
        if not (self.enabled and self.up and block_hashes):
            return [False] * len(block_hashes)
        pipe = self.client.pipeline(transaction=False)
        for block_hash in block_hashes:
            pipe.exists(self.key(block_hash))
        try:
            return [bool(found) for found in pipe.execute()]
        except REDIS_ERRORS as exc:
            self._failed(exc)
            return [False] * len(block_hashes)

    def leading_run(self, block_hashes: list[bytes]) -> int:
        """How many of `block_hashes`, from the first, Redis holds: one pipelined round trip."""
        found = self.present(block_hashes)
        return found.index(False) if False in found else len(found)

    def load_many(self, block_hashes: list[bytes]) -> list[memoryview | None]:
        """`load` of each hash in one round trip (MGET): a prompt's blocks come together."""
        if not (self.enabled and self.up and block_hashes):
            return super().load_many(block_hashes)  # misses, at once
        try:
            values = self.client.mget([self.key(h) for h in block_hashes])
        except REDIS_ERRORS as exc:
            self._failed(exc)
            values = [None] * len(block_hashes)
        payloads = [self._checked(h, v) for h, v in zip(block_hashes, values)]
        for payload in payloads:
            self._count_load(payload)
        return payloads

    def refresh(self) -> None:
        """Bring a down tier back when Redis answers; read INFO memory now and then."""
        now = time.monotonic()
        if not self.up:
            if now < self._retry_at:
                return
            try:
                self.client.ping()
            except REDIS_ERRORS as exc:
                self._failed(exc)
                return
            self._recovered()
        if now >= self._info_at:
            self._info_at = now + INFO_INTERVAL_SECONDS
            self._read_info()

    def snapshot(self) -> dict[str, int]:
        return {**super().snapshot(), "up": int(self.enabled and self.up)}

    def close(self) -> None:
        try:
            self.client.close()
        except REDIS_ERRORS as exc:
            logger.debug("redis tier: closing the client failed: %r", exc)

    # -- the Tier hooks -------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used

    def _contains(self, block_hash: bytes) -> bool:
        if not self.up:
            return False
        try:
            return bool(self.client.exists(self.key(block_hash)))
        except REDIS_ERRORS as exc:
            self._failed(exc)
            return False

    def _load(self, block_hash: bytes) -> memoryview | None:
        if not self.up:
            return None
        try:
            value = self.client.get(self.key(block_hash))
        except REDIS_ERRORS as exc:
            self._failed(exc)
            return None
        return self._checked(block_hash, value)

    def _checked(self, block_hash: bytes, value: bytes | None) -> memoryview | None:
        """The payload of a value read from Redis; a bad value is a miss, and deleted."""
        if value is None:
            return None
        payload = record.decode(self.namespace, block_hash, value)
        if payload is None:
            self._bad_record()
            self._delete(self.key(block_hash))
        return payload

    def _store(self, block_hash: bytes, data: bytes) -> bool:
        if not self.up:
            return False
        try:
            self.client.set(self.key(block_hash), data, ex=self.ttl_seconds)
        except REDIS_ERRORS as exc:
            self._failed(exc)
            return False
        return True

    # -- up and down --------------------------------------------------------------------
    def _delete(self, key: str) -> None:
        """Drop a bad value so that nobody reads it again (best effort). A replica that
        rewrote it meanwhile loses a good copy: a later miss, never wrong KV."""
        try:
            self.client.delete(key)
        except REDIS_ERRORS as exc:
            self._failed(exc)

    def _read_info(self) -> None:
        try:
            info = self.client.info("memory")
        except REDIS_ERRORS as exc:
            self._failed(exc)
            return
        with self.lock:
            self._used = int(info.get("used_memory", 0))
            self.capacity_bytes = int(info.get("maxmemory", 0))
            warn = self.capacity_bytes == 0 and not self._warned_unbounded
            self._warned_unbounded |= warn
        if warn:
            logger.warning("redis tier: %s has no maxmemory, so the tier is bounded only by "
                           "its TTL (%d s); set maxmemory with maxmemory-policy volatile-lru",
                           self.where, self.ttl_seconds)

    def _failed(self, exc: BaseException) -> None:
        """Count the error; the first one of an outage marks the tier down and warns."""
        with self.lock:
            self.stats.errors += 1
            went_down, self.up = self.up, False
            if went_down:
                self._backoff = BACKOFF_SECONDS[0]
            else:
                self._backoff = min(2 * self._backoff, BACKOFF_SECONDS[1])
            self._retry_at = time.monotonic() + self._backoff
        if went_down:
            logger.warning("redis tier unreachable at %s (%s: %s); its lookups miss until "
                           "it answers", self.where, type(exc).__name__, exc)

    def _recovered(self) -> None:
        with self.lock:
            came_back, self.up = not self.up, True
            self._info_at = 0.0  # read the server's memory again at once
        if came_back:
            logger.info("redis tier: %s answers again", self.where)
