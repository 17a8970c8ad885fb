"""The fleet's registry of system-prompt prefixes, kept in Redis.

Every replica records the system prompts it serves; a replica that starts
reads the most popular ones and prefills them before it reports ready
(service/fleet/warmup.py), so its first request with such a prompt is a cache hit.

Two replicas may share KV only when everything that decides the numbers
matches, so all keys live under a namespace of those things:

    pagedserve:prefixes:<fingerprint>:<block size>:<KV cache dtype>:h<hash scheme>:<salt id>
        :popular      ZSET  prefix id -> log2 popularity (below)
        :p:<id>       HASH  tokens (int32, little-endian), hashes (32 bytes each),
                            seen (sightings), last_used (unix seconds)
        :candidates   ZSET  ids seen fewer than min_seen times -> log2 popularity
        :counts       HASH  candidate id -> sightings
    pagedserve:namespaces   SET  every namespace key (for `pagedserve fleet`)

A prefix id is the hex of its last block hash: the hash chain makes it name
the whole prefix. One-off prompts stay candidates (ids and counts only, the
least popular trimmed), so they never crowd out the token lists worth keeping.

Popularity decays with a half-life h. A sighting at time t weighs 2^(t/h);
the sum of the weights, decayed to now, is 2^(score - now/h) with

    score = log2( sum over sightings of 2^(t_i / h) )

so the ranking never changes as time passes, and Redis never rewrites a
score to decay it. Kept as a log, the score cannot overflow.

Writes are sightings in a bounded buffer, flushed in batches by a background
task: a request only appends to a deque. While Redis is down the buffer
holds what fits and the rest is dropped and counted; nothing waits on it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
import time
from collections import deque
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from engine.core.block_hash import HASH_SCHEME_VERSION, cache_namespace

logger = logging.getLogger(__name__)

KEY_ROOT = "pagedserve"
NAMESPACES_KEY = f"{KEY_ROOT}:namespaces"
HASH_BYTES = 32
MAX_CANDIDATES = 10_000  # per namespace: prefixes seen fewer than min_seen times
BATCH = 64  # sightings per pipeline round trip
BACKOFF_SECONDS = (0.25, 10.0)  # first and longest wait before retrying Redis

# What a lost or refused connection raises: redis-py's errors and the socket's.
REDIS_ERRORS = (RedisError, OSError, asyncio.TimeoutError)


@dataclass(frozen=True)
class Namespace:
    """Everything two replicas must share for one's cached blocks to fit the other."""

    fingerprint: bytes  # the model fingerprint of the engine (weights, dtype, quantization)
    block_size: int
    kv_cache_dtype: str  # --kv-cache-dtype resolved ("bfloat16", "int8"): a block's bytes
    salt_id: str = "-"  # "-" when no tenant salt
    scheme: int = HASH_SCHEME_VERSION

    @property
    def key(self) -> str:
        space = cache_namespace(self.fingerprint, self.block_size, self.kv_cache_dtype,
                                self.scheme)
        return f"{KEY_ROOT}:prefixes:{space}:{self.salt_id}"


def salt_id(salt_digest: bytes) -> str:
    """A name for a tenant's namespace that reveals nothing of its salt."""
    if not salt_digest:
        return "-"
    return hashlib.sha256(b"pagedserve salt id\0" + salt_digest).hexdigest()[:16]


@dataclass(frozen=True)
class Prefix:
    """A system-prompt prefix as the registry holds it (full blocks only)."""

    namespace: str
    token_ids: list[int]
    block_hashes: list[bytes]
    seen: int
    last_used: float
    score: float  # log2 popularity; compare within one half-life setting

    @property
    def id(self) -> str:
        return self.block_hashes[-1].hex()

    def popularity(self, now: float, half_life: float) -> float:
        """The decayed number of sightings: each one counts 2^-(age / half-life)."""
        return 2.0 ** (self.score - now / half_life)


@dataclass(frozen=True)
class Sighting:
    namespace: str
    token_ids: list[int]
    block_hashes: list[bytes]
    time: float


# One sighting, atomically: bump a kept prefix, or count a candidate and
# promote it (tokens and hashes stored) once it was seen min_seen times.
# KEYS: popular, candidates, counts, entry, namespaces.
# ARGV: id, t/h, now, min_seen, max_prefixes, max_candidates, tokens, hashes,
#       namespace key, entry key prefix.
RECORD_SCRIPT = """
local function logadd(old, x)
  if not old then return x end
  old = tonumber(old)
  local hi, lo = math.max(old, x), math.min(old, x)
  return hi + math.log(1 + 2 ^ (lo - hi)) / math.log(2)
end
local function trim(zset, keep, forget)
  local extra = redis.call('ZCARD', zset) - keep
  if extra > 0 then
    local gone = redis.call('ZPOPMIN', zset, extra)
    for i = 1, #gone, 2 do forget(gone[i]) end
  end
end
local id, x = ARGV[1], tonumber(ARGV[2])
redis.call('SADD', KEYS[5], ARGV[9])
if redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('HINCRBY', KEYS[4], 'seen', 1)
  redis.call('HSET', KEYS[4], 'last_used', ARGV[3])
  redis.call('ZADD', KEYS[1], logadd(redis.call('ZSCORE', KEYS[1], id), x), id)
  return 1
end
local score = logadd(redis.call('ZSCORE', KEYS[2], id), x)
local seen = redis.call('HINCRBY', KEYS[3], id, 1)
if seen < tonumber(ARGV[4]) then
  redis.call('ZADD', KEYS[2], score, id)
  trim(KEYS[2], tonumber(ARGV[6]), function(gone) redis.call('HDEL', KEYS[3], gone) end)
  return 0
end
redis.call('ZREM', KEYS[2], id)
redis.call('HDEL', KEYS[3], id)
redis.call('HSET', KEYS[4], 'tokens', ARGV[7], 'hashes', ARGV[8], 'seen', seen,
           'last_used', ARGV[3])
redis.call('ZADD', KEYS[1], score, id)
trim(KEYS[1], tonumber(ARGV[5]), function(gone) redis.call('DEL', ARGV[10] .. gone) end)
return 2
"""


def connect(url: str) -> aioredis.Redis:
    """A client that fails fast: our loops retry with backoff, so redis-py must not
    (its own retries would hold a request or the readiness check for seconds)."""
    return aioredis.from_url(
        url, socket_connect_timeout=1.0, socket_timeout=2.0,
        retry=Retry(NoBackoff(), 0), retry_on_error=[],
    )


class PrefixRegistry:
    def __init__(
        self,
        client: aioredis.Redis,
        *,
        min_seen: int = 2,
        half_life_seconds: float = 3600.0,
        max_prefixes: int = 1000,
        buffer_size: int = 1024,
    ) -> None:
        self.client = client
        self.min_seen = min_seen
        self.half_life = half_life_seconds
        self.max_prefixes = max_prefixes
        self.buffer_size = buffer_size
        self.redis_up = False  # the latest command's outcome
        self.recorded = 0  # sightings written to Redis
        self.dropped = 0  # sightings lost to a full buffer while Redis was slow or down
        self._buffer: deque[Sighting] = deque()
        self._pending = asyncio.Event()
        self._record = client.register_script(RECORD_SCRIPT)

    # -- writes -------------------------------------------------------------------
    def record(self, namespace: Namespace, token_ids: list[int], block_hashes: list[bytes],
               now: float | None = None) -> None:
        """Note one use of a prefix (full blocks). Never waits: buffered or dropped."""
        if not block_hashes or len(token_ids) != len(block_hashes) * namespace.block_size:
            raise ValueError("a prefix is whole blocks: one hash per block_size tokens")
        if len(self._buffer) >= self.buffer_size:
            self.dropped += 1
            return
        self._buffer.append(Sighting(namespace.key, list(token_ids), list(block_hashes),
                                     time.time() if now is None else now))
        self._pending.set()

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    async def run(self) -> None:
        """Flush sightings as they come; back off while Redis fails (a background task)."""
        delay = BACKOFF_SECONDS[0]
        while True:
            await self._pending.wait()
            try:
                await self.flush()
            except REDIS_ERRORS as exc:
                self.mark_down(exc)
                await asyncio.sleep(delay)
                delay = min(2 * delay, BACKOFF_SECONDS[1])
            else:
                delay = BACKOFF_SECONDS[0]

    async def flush(self) -> None:
        """Write everything buffered now, a batch per round trip."""
        while self._buffer:
            batch = [self._buffer[i] for i in range(min(BATCH, len(self._buffer)))]
            # `async with`: a pipeline that fails before it executes (loading the
            # script) still gives its connection back, and is not reported unclosed.
            async with self.client.pipeline(transaction=False) as pipe:
                for sighting in batch:
                    keys, args = self._script_args(sighting)
                    await self._record(keys=keys, args=args, client=pipe)
                await pipe.execute()
            self.mark_up()
            for _ in batch:  # only now: a failed batch is sent again (at least once)
                self._buffer.popleft()
            self.recorded += len(batch)
        self._pending.clear()

    def _script_args(self, sighting: Sighting) -> tuple[list[str], list]:
        ns, prefix_id = sighting.namespace, sighting.block_hashes[-1].hex()
        keys = [f"{ns}:popular", f"{ns}:candidates", f"{ns}:counts", f"{ns}:p:{prefix_id}",
                NAMESPACES_KEY]
        tokens = struct.pack(f"<{len(sighting.token_ids)}i", *sighting.token_ids)
        args = [prefix_id, repr(sighting.time / self.half_life), repr(sighting.time),
                self.min_seen, self.max_prefixes, MAX_CANDIDATES, tokens,
                b"".join(sighting.block_hashes), ns, f"{ns}:p:"]
        return keys, args

    # -- reads --------------------------------------------------------------------
    async def top(self, namespaces: list[str], limit: int) -> list[Prefix]:
        """The `limit` most popular kept prefixes of these namespace keys, most popular first."""
        async with self.client.pipeline(transaction=False) as pipe:
            for namespace in namespaces:
                pipe.zrevrange(f"{namespace}:popular", 0, limit - 1, withscores=True)
            results = await self._execute(pipe)
        ranked = []
        for namespace, members in zip(namespaces, results):
            ranked += [(score, namespace, member.decode()) for member, score in members]
        ranked.sort(reverse=True)
        ranked = ranked[:limit]
        async with self.client.pipeline(transaction=False) as pipe:
            for _, ns, prefix_id in ranked:
                pipe.hgetall(f"{ns}:p:{prefix_id}")
            entries = await self._execute(pipe) if ranked else []
        prefixes = []
        for (score, ns, prefix_id), entry in zip(ranked, entries):
            prefix = _decode_entry(ns, prefix_id, score, entry)
            if prefix is not None:
                prefixes.append(prefix)
        return prefixes

    async def namespaces(self) -> list[str]:
        """Every namespace any replica has recorded into."""
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.smembers(NAMESPACES_KEY)
            (members,) = await self._execute(pipe)
        return sorted(member.decode() for member in members)

    async def ping(self) -> bool:
        """Whether Redis answers now (updates redis_up)."""
        try:
            await self.client.ping()
        except REDIS_ERRORS as exc:
            self.mark_down(exc)
            return False
        self.mark_up()
        return True

    async def _execute(self, pipe) -> list:
        try:
            results = await pipe.execute()
        except REDIS_ERRORS as exc:
            self.mark_down(exc)
            raise
        self.mark_up()
        return results

    def mark_up(self) -> None:
        if not self.redis_up:
            logger.info("prefix registry: Redis is reachable")
        self.redis_up = True

    def mark_down(self, exc: BaseException) -> None:
        if self.redis_up:
            logger.warning("prefix registry: Redis is unreachable (%r); serving goes on, "
                           "sightings are buffered up to %d", exc, self.buffer_size)
        self.redis_up = False


def _decode_entry(namespace: str, prefix_id: str, score: float, entry: dict) -> Prefix | None:
    """A registry entry back to a Prefix; None for one that is gone or malformed."""
    tokens, hashes = entry.get(b"tokens", b""), entry.get(b"hashes", b"")
    if not hashes or len(hashes) % HASH_BYTES or len(tokens) % 4:
        return None
    block_hashes = [hashes[i:i + HASH_BYTES] for i in range(0, len(hashes), HASH_BYTES)]
    token_ids = list(struct.unpack(f"<{len(tokens) // 4}i", tokens))
    if block_hashes[-1].hex() != prefix_id or len(token_ids) % len(block_hashes):
        logger.warning("prefix registry: entry %s in %s is malformed; skipped", prefix_id,
                       namespace)
        return None
    return Prefix(namespace, token_ids, block_hashes, int(entry.get(b"seen", 0)),
                  float(entry.get(b"last_used", 0)), score)
