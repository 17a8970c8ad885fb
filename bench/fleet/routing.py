"""`pagedserve bench fleet --routing`: one multi-tenant workload through each way of
spreading it over N replicas, with real processes on loopback.

    N replicas (pagedserve serve, a KV pool smaller than the tenants'
    prefixes, KV events and replay on loopback), started once
    for mode in round_robin, nginx, cache_aware, kv_aware:    (one at a time)
        every replica's prefix cache reset (the mode starts cold; its
        AllBlocksCleared event reaches a kv_aware router's replay too), one
        warm-up chat each
        the mode's front: vllm-router --policy round_robin | nginx hashing
        X-Session-ID | vllm-router cache_aware | vllm-router kv_aware
        the same conversations: each a tenant's system prompt (T distinct ones)
        and a first question, starting at Poisson arrivals; each follow-up turn
        quotes the conversation so far and asks again after a think time
        the front stopped

The replicas outlive the modes: a reset empties what a restart would (no
request runs between modes) without N server starts per mode.

Per mode: the prefix hit rate and its share of the ideal (bench/fleet/routing_report.py
defines the oracle), TTFT p50/p90 (streamed, to the first content token, at
the client), output tok/s over the mode's span, and requests per replica (each
replica's finished-request counter, less its warm-up).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.progress import Progress

from bench.common.replicas import WORDS, Replica, system_prompts
from bench.common.report import write_json
from bench.fleet.routing_fronts import (
    MODES,
    missing_tools,
    start_front,
    start_replicas,
    stop_replicas,
)
from bench.fleet.routing_report import print_report, summarize, targets
from clients.python import AsyncClient


@dataclass(frozen=True)
class Turn:
    conversation: int
    turn: int
    tenant: int
    wait: float  # turn 0: seconds from the run's start; later turns: after the last answer
    question: str


def plan(args) -> list[list[Turn]]:
    """The conversations, the same in every mode: Poisson starts, exponential think times."""
    rng = random.Random(args.seed)
    start, conversations = 0.0, []
    for c in range(args.conversations):
        start += rng.expovariate(args.rate)
        tenant = rng.randrange(args.tenants)
        conversations.append([
            Turn(c, k, tenant, start if k == 0 else rng.expovariate(1 / args.think_seconds),
                 f"Customer {c}, question {k + 1}: how much is a {rng.choice(WORDS)} "
                 f"and a {rng.choice(WORDS)}?")
            for k in range(args.turns)])
    return conversations


async def ask(client: AsyncClient, messages: list[dict], turn: Turn, args, origin: float) -> dict:
    """One streamed chat: its timings (from `origin`), usage and answer, or its error."""
    sent = time.perf_counter()
    record = {"conversation": turn.conversation, "turn": turn.turn, "tenant": turn.tenant,
              "sent": sent - origin, "ttft": 0.0, "e2e": 0.0, "prompt_tokens": 0,
              "cached_tokens": 0, "completion_tokens": 0, "error": "", "answer": ""}
    pieces, first = [], None
    try:
        stream = await client.chat_stream(messages, max_tokens=args.max_tokens, temperature=0)
        async for piece in stream:
            first = first or time.perf_counter()
            pieces.append(piece)
        done = time.perf_counter()
        record.update(ttft=(first or done) - sent, e2e=done - sent, answer="".join(pieces),
                      prompt_tokens=stream.usage.prompt_tokens,
                      cached_tokens=stream.usage.cached_tokens,
                      completion_tokens=stream.usage.completion_tokens)
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        record.update(e2e=time.perf_counter() - sent, error=f"{type(exc).__name__}: {exc}")
    return record


async def converse(url: str, turns: list[Turn], system: str, args, origin: float,
                   records: list[dict], advance) -> None:
    """One conversation, turn after turn, through the front (X-Session-ID: its id)."""
    messages = [{"role": "system", "content": system}]
    async with AsyncClient(url, timeout=1800, max_retries=0, model=args.served_name,
                           session_id=f"conversation-{turns[0].conversation}") as client:
        await asyncio.sleep(max(0.0, origin + turns[0].wait - time.perf_counter()))
        for k, turn in enumerate(turns):
            if k:
                await asyncio.sleep(turn.wait)
            messages.append({"role": "user", "content": turn.question})
            record = await ask(client, list(messages), turn, args, origin)
            record["messages"] = list(messages)
            records.append(record)
            if record["error"]:
                advance(len(turns) - k)  # the rest of the conversation is not sent
                return
            advance(1)
            messages.append({"role": "assistant", "content": record["answer"]})


async def drive(url: str, conversations: list[list[Turn]], systems: list[str], args,
                advance) -> list[dict]:
    records: list[dict] = []
    origin = time.perf_counter() + 0.1
    await asyncio.gather(*(converse(url, turns, systems[turns[0].tenant], args, origin,
                                    records, advance) for turns in conversations))
    return sorted(records, key=lambda r: r["sent"])


def finished_requests(replica: Replica) -> int:
    text = httpx.get(f"{replica.url}/metrics", timeout=30).text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pagedserve:request_success_total")))


def warm_up(replicas, model: str) -> list[int]:
    """One short chat straight to each replica (first-request costs off the clock);
    each one's finished-request count after it."""
    for r in replicas:
        httpx.post(f"{r.url}/v1/chat/completions", timeout=600, json={
            "model": model, "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 2}).raise_for_status()
    return [finished_requests(r.replica) for r in replicas]


def render_tokens(url: str, records: list[dict], model: str) -> None:
    """Each record's prompt token ids, from the serving path's own render route."""
    with httpx.Client(base_url=url, timeout=120) as http:
        for r in records:
            response = http.post("/v1/chat/completions/render", json={
                "model": model, "messages": r.pop("messages"), "max_tokens": 1})
            response.raise_for_status()
            r["tokens"] = response.json()["token_ids"]


def run_mode(mode: str, replicas, conversations, systems, args, log_dir: Path, progress) -> dict:
    reset_prefix_caches(replicas)
    before = warm_up(replicas, args.served_name)
    front = start_front(mode, replicas, args.served_name, log_dir)
    try:
        task = progress.add_task(mode, total=sum(len(c) for c in conversations))
        records = asyncio.run(drive(front.url, conversations, systems, args,
                                    lambda n: progress.advance(task, n)))
    finally:
        front.stop()
    per_replica = [finished_requests(r.replica) - b for r, b in zip(replicas, before)]
    render_tokens(replicas[0].url, records, args.served_name)
    return summarize(mode, records, per_replica, args.block_size)


def reset_prefix_caches(replicas) -> None:
    """Every replica's prefix cache emptied: between modes no request runs, so
    nothing stays cached from the mode before."""
    for r in replicas:
        httpx.post(f"{r.url}/reset_prefix_cache", timeout=60).raise_for_status()


def replica_flags(args) -> list[str]:
    return ["--model", args.model, "--served-model-name", args.served_name,
            "--kv-cache-memory-bytes", str(args.replica_kv_bytes),
            "--max-model-len", str(args.max_model_len), "--num-threads", str(args.replica_threads),
            "--block-size", str(args.block_size), *args.server_args]


def run_benchmark(args, log_dir: Path) -> dict:
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise ValueError(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    missing = missing_tools(modes)
    if missing:
        raise SystemExit("not installed: " + "; ".join(missing))
    conversations = plan(args)
    systems = system_prompts(args.tenants, args.tenant_words, args.seed)
    results = []
    replicas = start_replicas(replica_flags(args), args.replicas, log_dir, "routing")
    try:
        for r in replicas:
            r.replica.wait_ready()
        with Progress(transient=False) as progress:
            for mode in modes:
                results.append(run_mode(mode, replicas, conversations, systems, args, log_dir,
                                        progress))
    finally:
        stop_replicas(replicas)
    first = [r for r in results[0]["requests_detail"] if r["turn"] == 0 and not r["error"]]
    workload = {k: getattr(args, k) for k in (
        "replicas", "tenants", "tenant_words", "conversations", "turns", "rate", "think_seconds",
        "max_tokens", "replica_kv_bytes", "max_model_len", "replica_threads", "block_size",
        "seed", "model")}
    workload["first_turn_prompt_tokens_mean"] = (sum(r["prompt_tokens"] for r in first)
                                                 / max(1, len(first)))
    workload["conversation_starts"] = [round(c[0].wait, 3) for c in conversations]
    return {"workload": workload, "command": ["pagedserve", "bench", "fleet", *args.argv],
            "modes": results, "targets": targets({m["mode"]: m for m in results})}


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--routing: one multi-tenant workload through each router")
    g.add_argument("--routing", action="store_true",
                   help="compare round robin, nginx session hashing, vllm-router "
                        "cache_aware and kv_aware instead of the warm-up benchmark")
    g.add_argument("--modes", default=",".join(MODES), help="comma-separated, run in order")
    g.add_argument("--replicas", type=int, default=3)
    g.add_argument("--tenants", type=int, default=8, help="distinct system prompts")
    g.add_argument("--tenant-words", type=int, default=1200,
                   help="words per system prompt (500 give ~600 tokens, 1200 ~1.4k)")
    g.add_argument("--conversations", type=int, default=64)
    g.add_argument("--turns", type=int, default=3, help="turns per conversation")
    g.add_argument("--rate", type=float, default=0.5, help="conversation starts per second "
                   "(Poisson)")
    g.add_argument("--think-seconds", type=float, default=2.0,
                   help="mean pause before a follow-up turn (exponential)")
    g.add_argument("--max-tokens", type=int, default=32, help="per answer")
    g.add_argument("--replica-kv-bytes", type=int, default=96 << 20,
                   help="each replica's --kv-cache-memory-bytes (96 MiB: 273 blocks of 16 "
                        "SmolLM2 tokens in bf16, about 3 of the default 8 tenants' prefixes)")
    g.add_argument("--max-model-len", type=int, default=2048,
                   help="each replica's (one such sequence must fit its KV pool)")
    g.add_argument("--replica-threads", type=int, default=1,
                   help="each replica's --num-threads (N replicas share the machine's cores)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--log-dir", default=None,
                   help="keep the replicas' and fronts' logs here (default: a temporary folder)")


def main(args, argv: list[str]) -> int:
    args.argv, args.served_name = argv, args.model.rstrip("/").rsplit("/", 1)[-1]
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        report = run_benchmark(args, Path(args.log_dir))
    else:
        with tempfile.TemporaryDirectory(prefix="pagedserve-routing-") as folder:
            report = run_benchmark(args, Path(folder))
    print_report(report)
    if args.output:
        write_json(Path(args.output), report)
    return 0
