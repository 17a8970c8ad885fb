"""This replica's part in the fleet; only with --redis-url.

    start:    warm-up task ─ registry.top() → prefill → warming = False (/health 200)
                           └ then, every refresh period while idle: warm again
              flush task   ─ buffered sightings → Redis, backing off while it is down
              beat task    ─ presence key every heartbeat period; redis_up follows
    request:  a chat with a system prompt → observe_chat() → a background task finds
              the system turn's full blocks and buffers a sighting (never awaited
              by the request)
    stop:     tasks cancelled, presence key removed

Redis is never fatal: down at start, the warm-up finds nothing and the replica
is ready at once; lost later, requests are served as before, sightings wait
in a bounded buffer, and every loop retries until it is back.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from engine.frontend.async_engine import EngineDeadError
from engine.core.block_hash import prefix_hashes, salt_digest
from engine.frontend.chat_template import ChatTemplateError, render_chat_text
from service.config import FleetConfig, resolved_replica_id
from service.fleet.presence import ReplicaInfo, beat, leave
from service.fleet.registry import REDIS_ERRORS, Namespace, PrefixRegistry, connect, salt_id
from service.fleet.warmup import Budget, Tenant, WarmResult, fully_cached, warm
from service.guards.tenancy import cache_salt

if TYPE_CHECKING:
    from service.serving.state import ServiceState

logger = logging.getLogger(__name__)

WARM_BLOCKS_SHARE = 0.2  # default warm-up budget: a fifth of the KV pool
SYSTEM_TOKENS_CACHED = 256  # distinct system turns whose tokens are kept
READY_BEAT_SECONDS = 1.0  # the most readiness waits to announce itself in Redis
STOP_SECONDS = 5.0  # the most shutdown waits for the fleet's tasks to end


class Fleet:
    def __init__(self, state: ServiceState, config: FleetConfig) -> None:
        self.state = state
        self.config = config
        self.client = connect(config.redis_url)
        self.registry = PrefixRegistry(
            self.client, min_seen=config.min_seen, half_life_seconds=config.half_life_seconds,
            max_prefixes=config.max_prefixes, buffer_size=config.buffer_size,
        )
        self.replica_id = resolved_replica_id(config)
        self.url = config.advertise_url or _default_url(state.config.host, state.config.port)
        self.tenants = tenants(state)
        self.warming = True  # /health answers 503 "warming" until the first warm-up ends
        self.warm = WarmResult()  # the latest warm-up's outcome
        self.started = time.time()
        self._tasks: set[asyncio.Task] = set()
        self._publishing = asyncio.Lock()  # one presence write at a time, newest last
        # System messages -> their rendered tokens: popular prompts repeat, and
        # rendering and tokenizing is the costly part of recording one.
        self._system_tokens: OrderedDict[tuple, list[int]] = OrderedDict()

    # -- life cycle ----------------------------------------------------------------
    def start(self) -> None:
        for work in (self._warm_then_refresh(), self.registry.run(), self._heartbeat()):
            self._spawn(work)

    async def stop(self) -> None:
        """Cancel the fleet's tasks and leave Redis, each step bounded: the server's
        shutdown waits on this, and one task that outlives its cancel (a CI run
        once saw a shutdown stuck here past 60 s) must not hold the engine up."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=STOP_SECONDS)
            if stuck:
                logger.warning("fleet: %d task(s) still running %.0f s after their cancel: %s",
                               len(stuck), STOP_SECONDS, ", ".join(sorted(_name(t) for t in stuck)))
        try:
            await asyncio.wait_for(leave(self.client, self.replica_id), 1.0)
        except REDIS_ERRORS:
            pass  # the key expires on its own
        try:
            await asyncio.wait_for(self.client.aclose(), 1.0)
        except REDIS_ERRORS:
            pass  # its sockets close with the process

    def _spawn(self, work) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- recording -----------------------------------------------------------------
    def observe_chat(self, system: list[dict], token_ids: list[int], api_key: str | None) -> None:
        """A chat request began with these system messages: record its system prefix."""
        if system and len(self._tasks) < 3 + self.config.buffer_size:
            self._spawn(self._observe(system, token_ids, api_key))

    async def _observe(self, system: list[dict], token_ids: list[int],
                       api_key: str | None) -> None:
        state = self.state
        block_size = state.engine.config.block_size
        key = tuple((m["role"], m["content"]) for m in system)
        alone = self._system_tokens.get(key)
        if alone is None:
            try:
                alone = await state.off_loop(system_tokens, state.tokenizer, system)
            except ChatTemplateError:
                return
            except Exception:  # noqa: BLE001 - a background task: log, never end the request
                logger.exception("fleet: could not render the system turn of a request")
                return
            self._system_tokens[key] = alone
            if len(self._system_tokens) > SYSTEM_TOKENS_CACHED:
                self._system_tokens.popitem(last=False)
        else:
            self._system_tokens.move_to_end(key)
        length = common_blocks(alone, token_ids, block_size)
        if length == 0:
            return
        salt = cache_salt(state.config, api_key, None)
        tokens = token_ids[:length]
        hashes = prefix_hashes(tokens, block_size, state.engine.fingerprint, salt_digest(salt))
        self.registry.record(namespace(state, salt), tokens, hashes)

    # -- warming -------------------------------------------------------------------
    def budget(self) -> Budget:
        blocks = self.config.warm_max_blocks
        if blocks is None:
            total = self.state.engine.stats.counters.get("kv_blocks_total", 0)
            blocks = int(WARM_BLOCKS_SHARE * total)
        return Budget(self.config.warm_max_prefixes, blocks, self.config.warm_timeout_seconds)

    async def _warm_then_refresh(self) -> None:
        await self._warm(idle=None)  # never raises: a failed warm-up still ends warming
        # Redis hears "ok" before /health does: a router or test that saw the
        # 200 never reads "warming" from the fleet a heartbeat later. A Redis
        # that hangs may delay readiness by a second, never hold it.
        try:
            await asyncio.wait_for(self._publish(warming=False), READY_BEAT_SECONDS)
        except TimeoutError:
            pass  # the heartbeat says "ok" once Redis answers
        self.warming = False
        while True:
            await asyncio.sleep(self.config.refresh_seconds)
            if self.idle():
                await self._warm(idle=self.idle)

    async def _warm(self, idle) -> None:
        try:
            result = await warm(self.state.engine, self.registry, self.tenants, self.budget(),
                                idle=idle)
        except REDIS_ERRORS as exc:
            logger.warning("warm-up skipped: Redis is unreachable (%r)", exc)
            return
        except EngineDeadError:
            return
        except Exception:  # noqa: BLE001 - the refresh loop must outlive one bad warm-up
            logger.exception("warm-up failed; serving goes on")
            return
        self.warm = result
        if idle is None or result.prefilled:
            logger.info("warm-up: %d prefixes (%d blocks) cached in %.1f s, %d skipped",
                        len(result.prefixes), result.blocks, result.seconds, result.skipped)

    def idle(self) -> bool:
        """Nothing to serve: no request open, none running or waiting in the engine."""
        engine = self.state.engine
        counters = engine.stats.counters
        return (not engine.num_open and not counters.get("num_requests_running")
                and not counters.get("num_requests_waiting"))

    # -- presence ------------------------------------------------------------------
    async def _heartbeat(self) -> None:
        while True:
            await self._publish()
            await asyncio.sleep(self.config.heartbeat_seconds)

    def announce(self) -> None:
        """Publish this replica's state now (it just started draining, say)."""
        self._spawn(self._publish())

    async def _publish(self, warming: bool | None = None) -> None:
        """Write this replica's presence now. The lock keeps a beat that read the
        state earlier from landing after, and overwriting, a newer one."""
        async with self._publishing:
            try:
                await beat(self.client, await self.info(warming), self.config.heartbeat_seconds)
                self.registry.mark_up()
            except REDIS_ERRORS as exc:
                self.registry.mark_down(exc)

    async def info(self, warming: bool | None = None) -> ReplicaInfo:
        state = self.state
        counters = state.engine.stats.counters
        total = counters.get("kv_blocks_total", 0)
        prefixes = self.warm.prefixes
        try:
            held = await fully_cached(state.engine, prefixes)
        except EngineDeadError:
            held = [False] * len(prefixes)
        return ReplicaInfo(
            id=self.replica_id, url=self.url, model=state.model_name,
            namespace=namespace(state, None).key, status=self.status(warming),
            running=counters.get("num_requests_running", 0),
            waiting=counters.get("num_requests_waiting", 0),
            kv_usage=1.0 - counters.get("kv_blocks_free", 0) / total if total else 0.0,
            warm_prefixes=[p.id for p, ok in zip(prefixes, held) if ok],
            started=self.started, updated=time.time(),
        )

    def status(self, warming: bool | None = None) -> str:
        """As the fleet sees it; `warming` overrides the flag (for the beat that
        announces the end of the warm-up just before the flag drops)."""
        if self.state.engine.failure is not None:
            return "dead"
        if self.state.draining:
            return "draining"
        return "warming" if (self.warming if warming is None else warming) else "ok"


def namespace(state: ServiceState, salt: str | None) -> Namespace:
    """The registry namespace of requests with this cache salt on this replica."""
    engine = state.engine
    return Namespace(engine.fingerprint, engine.config.block_size, engine.kv_cache_dtype,
                     salt_id(salt_digest(salt)))


def tenants(state: ServiceState) -> list[Tenant]:
    """The namespaces this replica warms: untenanted requests, then each API key's."""
    salts = [None]
    if not state.config.share_prefix_cache_across_keys:
        salts += [cache_salt(state.config, key, None) for key in state.config.api_keys]
    return [Tenant(namespace(state, salt), salt) for salt in salts]


def system_tokens(tokenizer, system: list[dict]) -> list[int]:
    """The system messages alone, rendered by the chat template and tokenized."""
    text = render_chat_text(tokenizer, system, add_generation_prompt=False)
    return tokenizer.encode(text, add_special_tokens=False)


def common_blocks(alone: list[int], token_ids: list[int], block_size: int) -> int:
    """How many leading tokens of the prompt are the system turn, cut to full blocks.

    The tokens the system turn rendered alone shares with the whole prompt are
    the prefix: a template may render it differently once more messages follow,
    or a merge may cross the boundary, and the common part is what every
    request with this system prompt really shares.
    """
    common = 0
    for a, b in zip(alone, token_ids):
        if a != b:
            break
        common += 1
    return common // block_size * block_size


def _default_url(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://{host}:{port}"


def _name(task: asyncio.Task) -> str:
    """A task's coroutine name, for a log line."""
    coro = task.get_coro()
    return getattr(coro, "__qualname__", None) or task.get_name()
