"""`pagedserve bench offload`: what the KV offload tiers buy when prefixes outgrow the pool.

    pagedserve bench offload [--prompts 12] [--rounds 4] [--pool-prompts 4] [--output r.json]

Part 1, in this process. --prompts distinct system prompts of --system-len
random tokens, each followed by its own --question-len-token question, cycle
--rounds times through a device pool that holds only --pool-prompts of them
(max_model_len is one request), so a prompt has been evicted by the time it
comes round again. --concurrency requests are in flight at a time (a closed
loop: one finishes, the next arrives); greedy, --output-len tokens each.
One fresh engine per setting: no tiers, then each tier alone (host memory,
disk, Redis). Round 1 computes every prompt and round 2 stores it (its second
sighting); from round 3 on the tiers can serve it. Reported per setting:
output tokens per second over the whole run, the median TTFT of rounds >= 3,
prompt tokens computed and blocks loaded.

Part 2, real processes (--skip-warmup leaves it out). Replica A
(`--redis-url R --kv-offload-redis-url R`) serves --warm-prompts system
prompts three times each, so the fleet registry ranks them and the Redis tier
holds their blocks. Then a new replica B starts twice, once recomputing its
warm-up (`--redis-url R`) and once loading it from the Redis tier (both
flags): the time from its first "warming" answer to "ok", and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import redis
from tqdm.auto import tqdm

from bench.common.replicas import Replica, questions, start_redis, system_prompts
from bench.common.report import print_table, write_json
from bench.fleet.fleet import sequential
from engine.args import add_engine_args, config_from_args
from engine.frontend.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

@dataclass
class Setting:
    name: str
    output_tok_s: float
    ttft_median_ms: float  # rounds >= 3, when a tier can serve the prompt
    ttft_cold_ms: float  # round 1: every prompt computed
    prompt_tokens_computed: int
    blocks_loaded: int
    tier_hits: int
    seconds: float


def prompts_of(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)  # the engine's --seed: the workload's too
    systems = [[rng.randrange(3, vocab) for _ in range(args.system_len)]
               for _ in range(args.prompts)]
    return [s + [rng.randrange(3, vocab) for _ in range(args.question_len)]
            for _ in range(args.rounds) for s in systems]


def closed_loop(engine: LLMEngine, prompts: list[list[int]], args, label: str):
    """Keep --concurrency requests in flight; per request its TTFT (s); total seconds."""
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    added: dict[str, float] = {}
    ttft: dict[str, float] = {}
    queue = list(enumerate(prompts))
    start = time.perf_counter()
    with tqdm(total=len(prompts), desc=label, leave=False) as bar:
        while queue or engine.has_unfinished_requests():
            while queue and len(added) - bar.n < args.concurrency:
                i, prompt = queue.pop(0)
                added[str(i)] = time.perf_counter()
                engine.add_request(str(i), prompt, params)
            for out in engine.step():
                if out.request_id not in ttft and out.outputs[0].token_ids:
                    ttft[out.request_id] = time.perf_counter() - added[out.request_id]
                bar.update(int(out.finished))
    return [ttft[str(i)] for i in range(len(prompts))], time.perf_counter() - start


def run_setting(config, name: str, prompts, args) -> Setting:
    engine = LLMEngine(config)
    try:
        ttfts, seconds = closed_loop(engine, prompts, args, name)
        stats, offload = engine.stats(), engine.offload_stats() or {}
    finally:
        engine.close()
    warm = ttfts[2 * args.prompts:] or ttfts
    hits = sum(t["hits"] for t in offload.get("tiers", {}).values())
    return Setting(name, len(prompts) * args.output_len / seconds,
                   1000 * statistics.median(warm), 1000 * statistics.median(ttfts[:args.prompts]),
                   stats["prompt_tokens_computed"], offload.get("blocks_loaded", 0), hits, seconds)


def part_one(args, base, folder: Path, redis_url: str) -> list[Setting]:
    probe = LLMEngine(base.replace(max_model_len=min(base.max_model_len or 2048, 2048)))
    block_bytes = probe.runner.bytes_per_block()
    vocab = probe.vocab_size
    probe.close()
    del probe
    # max_model_len is one request, so that the pool is --pool-prompts requests (the
    # engine wants room for one max_model_len sequence, and caches in all of it).
    per_prompt = -(-(args.system_len + args.question_len + args.output_len) // base.block_size)
    pool = (max(args.pool_prompts, 1) * per_prompt + 1) * block_bytes
    config = base.replace(max_model_len=per_prompt * base.block_size, kv_cache_memory_bytes=pool)
    prompts = prompts_of(args, vocab)
    tiers = {
        "off": {},
        "host": {"kv_offload_host_bytes": 4 << 30},
        "disk": {"kv_offload_disk_dir": str(folder / "disk")},
        "redis": {"kv_offload_redis_url": redis_url},
    }
    results = []
    for name in args.settings:
        redis.Redis.from_url(redis_url).flushall()
        results.append(run_setting(config.replace(**tiers[name]), name, prompts, args))
    return results


def warm_seconds(statuses: list[tuple[float, str]]) -> float:
    """From the first "warming" answer to "ok" (0 when it never reported warming)."""
    times = dict((status, t) for t, status in reversed(statuses))
    return statuses[-1][0] - times["warming"] if "warming" in times else 0.0


def part_two(args, log_dir: Path, redis_url: str) -> dict:
    redis.Redis.from_url(redis_url).flushall()
    base = ["--model", args.model, *args.server_args]
    systems = system_prompts(args.warm_prompts, args.warm_words, args.seed)
    both = ["--redis-url", redis_url, "--kv-offload-redis-url", redis_url]
    a = Replica.start(base + both + ["--replica-id", "A"], log_dir, "A")
    try:
        a.wait_ready()
        asked = questions(3 * len(systems), seed=args.seed)
        asyncio.run(sequential(a.url, [(systems[i % len(systems)], q)
                                       for i, q in enumerate(asked)]))
        time.sleep(2)  # the registry's sightings and the tier's stores are written
        blocks_stored = a.metric("kv_offload_blocks_stored_total")
    finally:
        a.stop()
    runs = {}
    for mode, flags in (("recompute", ["--redis-url", redis_url]), ("redis tier", both)):
        b = Replica.start(base + flags + ["--replica-id", "B"], log_dir, f"B-{mode}")
        try:
            statuses = b.wait_ready()
            runs[mode] = {"warm_seconds": warm_seconds(statuses),
                          "warm_blocks": b.metric("prefix_warm_blocks"),
                          "blocks_loaded": _metric_or_zero(b, "kv_offload_blocks_loaded_total")}
        finally:
            b.stop()
    return {"system_prompts": len(systems), "blocks_stored_by_a": blocks_stored, "runs": runs}


def _metric_or_zero(replica: Replica, name: str) -> float:
    try:
        return replica.metric(name)
    except KeyError:
        return 0.0


def print_report(report: dict) -> None:
    rows = [[s["name"], f"{s['output_tok_s']:.1f}", f"{s['ttft_median_ms']:.0f}",
             f"{s['ttft_cold_ms']:.0f}", str(s["prompt_tokens_computed"]),
             str(s["blocks_loaded"]), f"{s['seconds']:.1f}"] for s in report["settings"]]
    print_table(["tiers", "output tok/s", "TTFT median ms (rounds >= 3)", "TTFT ms (round 1)",
                 "prompt tokens computed", "blocks loaded", "seconds"], rows,
                title=report["workload"])
    off = report["settings"][0]
    for s in report["settings"][1:]:
        print(f"{s['name']}: throughput x{s['output_tok_s'] / off['output_tok_s']:.2f}, "
              f"warm TTFT x{s['ttft_median_ms'] / off['ttft_median_ms']:.3f} of {off['name']}")
    warm = report.get("warmup")
    if warm:
        runs = warm["runs"]
        ratio = runs["redis tier"]["warm_seconds"] / max(runs["recompute"]["warm_seconds"], 1e-9)
        print_table(["replica B warm-up", "seconds", "warm blocks", "blocks loaded"],
                    [[m, f"{r['warm_seconds']:.2f}", f"{r['warm_blocks']:.0f}",
                      f"{r['blocks_loaded']:.0f}"] for m, r in runs.items()],
                    title=f"{warm['system_prompts']} popular system prompts")
        print(f"warm-up from the Redis tier / recomputing: {ratio:.3f}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve bench offload",
                                description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=12, help="distinct system prompts")
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--pool-prompts", type=int, default=4,
                   help="prompts the device pool holds beside one max_model_len sequence")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--settings", nargs="+", default=["off", "host", "disk", "redis"],
                   choices=["off", "host", "disk", "redis"])
    p.add_argument("--skip-warmup", action="store_true", help="leave part 2 out")
    p.add_argument("--warm-prompts", type=int, default=16)
    p.add_argument("--warm-words", type=int, default=400, help="words per warm-up system prompt")
    p.add_argument("--output", default=None, help="write the report as JSON")
    add_engine_args(p)
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="part 2: flags for every replica (last on the line)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    base = config_from_args(args)
    with tempfile.TemporaryDirectory(prefix="pagedserve-offload-") as folder:
        server, redis_url = start_redis(Path(folder))
        try:
            time.sleep(0.5)
            settings = part_one(args, base, Path(folder), redis_url)
            report = {"workload": f"{args.prompts} prompts x {args.rounds} rounds, "
                                  f"{args.system_len}+{args.question_len} tokens in, "
                                  f"{args.output_len} out, pool: {args.pool_prompts} prompts",
                      "settings": [asdict(s) for s in settings]}
            if not args.skip_warmup:
                report["warmup"] = part_two(args, Path(folder), redis_url)
        finally:
            server.kill()
    print_report(report)
    if args.output:
        write_json(Path(args.output), report)
    return 0
