"""Warm-up: prefill the fleet's most popular system prompts into this replica's cache.

    registry.top()  ->  check each prefix  ->  mark its hashes popular  ->  prefill
    (Redis)             (hashes recomputed     (evicted last, counted      (prompt-only
                         here must match,       in prefix_warm_blocks)      requests, one
                         budget, not cached)                                output token)

At start-up this runs before /health reports 200, every prefix at once so the
engine batches them; later, while the replica is idle, it runs again to pick
up prefixes that became popular since, one at a time, and stops as soon as a
request arrives.

A prefix is prefilled as an ordinary request for its own tokens with one
greedy output token: its blocks are computed, registered in the prefix cache,
and stay cached when the request ends. A prefix whose stored hashes differ
from the ones this engine computes is skipped: the namespace should make
that impossible, but trusting Redis blindly could serve wrong K/V.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.frontend.async_engine import AsyncEngine
from engine.core.block_hash import prefix_hashes, salt_digest
from engine.sampling_params import SamplingParams
from service.fleet.registry import Namespace, Prefix, PrefixRegistry

logger = logging.getLogger(__name__)

# One greedy token: the least a request can produce, and deterministic.
WARM_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass(frozen=True)
class Tenant:
    """A namespace this replica serves, and the cache salt its requests carry."""

    namespace: Namespace
    salt: str | None


@dataclass
class WarmResult:
    prefixes: list[Prefix] = field(default_factory=list)  # in the cache when it ended
    blocks: int = 0  # blocks of those prefixes
    skipped: int = 0  # refused: hashes that do not match, too long, over the budget
    prefilled: int = 0  # prefixes this run computed (the others were cached already)
    seconds: float = 0.0


@dataclass(frozen=True)
class Budget:
    max_prefixes: int
    max_blocks: int
    timeout_seconds: float


async def warm(
    engine: AsyncEngine,
    registry: PrefixRegistry,
    tenants: list[Tenant],
    budget: Budget,
    *,
    idle: Callable[[], bool] | None = None,
) -> WarmResult:
    """Prefill the most popular prefixes within `budget`; mark them popular.

    `idle=None` (start-up) submits every prefix at once; otherwise prefixes go
    one at a time, and the warm-up stops when `idle()` turns false.
    """
    started = time.monotonic()
    result = WarmResult()
    top = await registry.top([t.namespace.key for t in tenants], budget.max_prefixes)
    salts = {t.namespace.key: t.salt for t in tenants}
    chosen = _within_budget(engine, top, salts, budget, result)
    hashes = [h for prefix in chosen for h in prefix.block_hashes]
    await engine.mark_popular(hashes)
    todo = [p for p, held in zip(chosen, await fully_cached(engine, chosen)) if not held]
    deadline = started + budget.timeout_seconds
    result.prefilled = len(todo)
    if idle is None:
        await _prefill(engine, todo, salts, deadline)
    else:
        for prefix in todo:
            if not idle() or time.monotonic() > deadline:
                break
            await _prefill(engine, [prefix], salts, deadline)
    result.prefixes = [p for p, held in zip(chosen, await fully_cached(engine, chosen)) if held]
    result.blocks = sum(len(p.block_hashes) for p in result.prefixes)
    result.seconds = time.monotonic() - started
    return result


async def fully_cached(engine: AsyncEngine, prefixes: list[Prefix]) -> list[bool]:
    """Whether each prefix's blocks are all in the prefix cache now."""
    cached = await engine.cached_prefix_blocks([p.block_hashes for p in prefixes])
    return [count == len(p.block_hashes) for count, p in zip(cached, prefixes)]


def _within_budget(engine: AsyncEngine, top: list[Prefix], salts: dict[str, str | None],
                   budget: Budget, result: WarmResult) -> list[Prefix]:
    """The prefixes to warm, most popular first: valid, fitting, within the budget."""
    config = engine.config
    chosen, blocks = [], 0
    for prefix in top:
        expected = prefix_hashes(prefix.token_ids, config.block_size,
                                 engine.fingerprint, salt_digest(salts[prefix.namespace]))
        if expected != prefix.block_hashes:
            logger.warning("warm-up: prefix %s does not hash here as it did where it was "
                           "recorded; skipped", prefix.id[:16])
        elif len(prefix.token_ids) >= config.max_model_len:
            logger.info("warm-up: prefix %s is longer than max_model_len", prefix.id[:16])
        elif blocks + len(prefix.block_hashes) > budget.max_blocks:
            pass  # a smaller one further down may still fit
        else:
            chosen.append(prefix)
            blocks += len(prefix.block_hashes)
            continue
        result.skipped += 1
    return chosen


async def _prefill(engine: AsyncEngine, prefixes: list[Prefix], salts: dict[str, str | None],
                   deadline: float) -> None:
    """Run each prefix as a one-token request; abort whatever is still running at
    the deadline (its finished blocks stay cached)."""
    streams = [engine.generate(f"warm-{uuid.uuid4().hex}", p.token_ids, WARM_PARAMS,
                               cache_salt=salts[p.namespace]) for p in prefixes]

    finished = []

    async def drain(stream) -> None:
        async for _ in stream:
            pass
        finished.append(stream)

    try:
        await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)),
                               max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        logger.warning("warm-up: time limit reached; %d prefix(es) left unfinished",
                       len(streams) - len(finished))
    finally:
        for stream in streams:
            stream.close()
