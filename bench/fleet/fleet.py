"""`pagedserve bench fleet`: what warm-up buys a new replica, with real processes.

    redis-server ──── replica A (pagedserve serve --redis-url)
         │              serves k system prompts, each 3 times: the registry keeps them
         │
         ├─ replica B, cold (no --redis-url)   ┐ each: start → /health 200 (statuses
         └─ replica B, warm (--redis-url)       ┘ seen on the way), warm blocks at
                                                  ready, first request's TTFT, prefix
                                                  hit rate of the first 10 requests
                                                  and of the next 20 (steady state)
    then rounds of 32 streams, on each B in turn: median ITL with Redis off / on

The hit rate is cached prompt tokens over prompt tokens (from each answer's
usage). Every replica runs the same flags but --redis-url, and only one is
measured at a time while the others stay idle, so the ratios compare like
with like.

`--routing` runs another benchmark instead (bench/fleet/routing.py): one multi-tenant
workload through round robin, nginx session hashing and vllm-router's
cache_aware and kv_aware policies, over N replicas whose prefix caches are reset
before each.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common.replicas import Replica, questions, start_redis, system_prompts
from bench.common.report import print_table, write_json
from bench.fleet import routing
from clients.python import AsyncClient


@dataclass
class Answer:
    ttft: float
    itl: list[float]
    prompt_tokens: int
    cached_tokens: int


async def chat(client: AsyncClient, system: str, user: str, max_tokens: int) -> Answer:
    """One streamed chat; TTFT and gaps measured at the client, usage from the server."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    start = last = time.perf_counter()
    ttft, gaps = 0.0, []
    stream = await client.chat_stream(messages, max_tokens=max_tokens, temperature=0,
                                      ignore_eos=True)
    async for _ in stream:
        now = time.perf_counter()
        if ttft == 0.0:
            ttft = now - start
        else:
            gaps.append(now - last)
        last = now
    return Answer(ttft, gaps, stream.usage.prompt_tokens, stream.usage.cached_tokens)


@dataclass
class ReplicaRun:
    mode: str  # "cold" or "warm"
    ready_seconds: float
    statuses: list[tuple[float, str]]
    warm_blocks_at_ready: float
    first_ttft: float
    first_cached: int
    first10_hit_rate: float
    steady_hit_rate: float
    itl_median_ms: float = 0.0  # the median of the rounds' medians
    itl_rounds_ms: list[float] = field(default_factory=list)
    stream_failures: int = 0
    answers: list[dict] = field(default_factory=list)


async def sequential(url: str, prompts: list[tuple[str, str]]) -> list[Answer]:
    async with AsyncClient(url, timeout=600, max_retries=0) as client:
        return [await chat(client, system, user, 4) for system, user in prompts]


async def streams(url: str, prompts: list[tuple[str, str]], max_tokens: int) -> list:
    """All prompts at once, streamed: answers, or the exception a stream ended with."""
    async with AsyncClient(url, timeout=1200, max_retries=0) as client:
        return await asyncio.gather(*(chat(client, s, u, max_tokens) for s, u in prompts),
                                    return_exceptions=True)


def hit_rate(answers: list[Answer]) -> float:
    return sum(a.cached_tokens for a in answers) / max(1, sum(a.prompt_tokens for a in answers))


def measure_replica(replica: Replica, mode: str, systems: list[str], args) -> ReplicaRun:
    """Ready, then the first 10 requests and the steady state, one at a time."""
    statuses = replica.wait_ready()
    warm_blocks = replica.metric("prefix_warm_blocks")
    asked = questions(args.first + args.steady, seed=args.seed + 1)
    prompts = [(systems[i % len(systems)], q) for i, q in enumerate(asked)]
    answers = asyncio.run(sequential(replica.url, prompts))
    first, steady = answers[:args.first], answers[args.first:]
    return ReplicaRun(mode, statuses[-1][0], statuses, warm_blocks, answers[0].ttft,
                      answers[0].cached_tokens, hit_rate(first), hit_rate(steady),
                      answers=[asdict(a) for a in answers])


def measure_streams(replica: Replica, run: ReplicaRun, systems: list[str], args) -> None:
    """One round of `args.streams` concurrent chats: median ITL, and how many failed."""
    asked = questions(args.streams, seed=args.seed + 2 + len(run.itl_rounds_ms))
    prompts = [(systems[i % len(systems)], q) for i, q in enumerate(asked)]
    results = asyncio.run(streams(replica.url, prompts, args.stream_tokens))
    gaps = [g for r in results if isinstance(r, Answer) for g in r.itl]
    run.itl_rounds_ms.append(1000 * statistics.median(gaps) if gaps else 0.0)
    run.itl_median_ms = statistics.median(run.itl_rounds_ms)
    run.stream_failures += sum(not isinstance(r, Answer) for r in results)


def seed_fleet(replica: Replica, systems: list[str], args) -> None:
    """Replica A serves every system prompt three times; wait until Redis has them."""
    asked = questions(3 * len(systems), seed=args.seed)
    asyncio.run(sequential(replica.url, [(systems[i % len(systems)], q)
                                         for i, q in enumerate(asked)]))
    deadline = time.monotonic() + 60
    while replica.metric("registry_sightings_recorded_total") < len(asked):
        if time.monotonic() > deadline:
            raise TimeoutError("replica A did not record its system prompts in Redis")
        time.sleep(0.1)


def run_benchmark(args, log_dir: Path) -> dict:
    redis, redis_url = start_redis(log_dir)
    base = ["--model", args.model, *args.server_args]
    systems = system_prompts(args.system_prompts, args.system_words, args.seed)
    replicas: list[Replica] = []
    try:
        a = Replica.start(base + ["--redis-url", redis_url, "--replica-id", "A"], log_dir, "A")
        replicas.append(a)
        a.wait_ready()
        seed_fleet(a, systems, args)
        runs = {}
        for mode in ("cold", "warm"):  # B-cold stays up, idle, while B-warm is measured
            flags = base + (["--redis-url", redis_url, "--replica-id", "B"]
                            if mode == "warm" else [])
            replicas.append(Replica.start(flags, log_dir, f"B-{mode}"))
            runs[mode] = measure_replica(replicas[-1], mode, systems, args)
        # Streams: Redis off and on in turn, so a drift of the machine's speed
        # falls on both alike.
        for i in range(args.rounds):
            for mode in (("cold", "warm") if i % 2 == 0 else ("warm", "cold")):
                measure_streams(replicas[1 if mode == "cold" else 2], runs[mode], systems, args)
        return {"system_prompts": len(systems), "runs": [asdict(r) for r in runs.values()]}
    finally:
        for replica in replicas:
            replica.stop()
        redis.kill()


def print_report(report: dict) -> None:
    runs = {r["mode"]: r for r in report["runs"]}
    rows = [[mode, f"{r['ready_seconds']:.1f}", f"{r['warm_blocks_at_ready']:.0f}",
             f"{1000 * r['first_ttft']:.0f}", str(r["first_cached"]),
             f"{r['first10_hit_rate']:.1%}", f"{r['steady_hit_rate']:.1%}",
             f"{r['itl_median_ms']:.1f}", str(r["stream_failures"])]
            for mode, r in runs.items()]
    print_table(["replica B", "ready s", "warm blocks", "first TTFT ms", "first cached",
                 "hit rate, first 10", "hit rate, steady", "ITL median ms", "failed"], rows,
                title=f"{report['system_prompts']} popular system prompts")
    cold, warm = runs["cold"], runs["warm"]
    print(f"first-request TTFT warm / cold: {warm['first_ttft'] / cold['first_ttft']:.3f}; "
          f"first-10 hit rate / steady state (warm): "
          f"{warm['first10_hit_rate'] / warm['steady_hit_rate']:.1%}")
    print("ITL median per round, ms: Redis off " + ", ".join(
        f"{v:.1f}" for v in cold["itl_rounds_ms"]) + "; Redis on " + ", ".join(
        f"{v:.1f}" for v in warm["itl_rounds_ms"]))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve bench fleet", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-words", type=int, default=300, help="words per system prompt")
    p.add_argument("--first", type=int, default=10)
    p.add_argument("--steady", type=int, default=20)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4,
                   help="rounds of --streams streams per replica, alternating Redis off/on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write the report as JSON")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="flags for every replica (last on the line)")
    routing.add_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.routing:
        return routing.main(args, argv)
    with tempfile.TemporaryDirectory(prefix="pagedserve-fleet-") as folder:
        report = run_benchmark(args, Path(folder))
    print_report(report)
    if args.output:
        write_json(Path(args.output), report)
    return 0

