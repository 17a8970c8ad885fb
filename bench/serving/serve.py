"""`pagedserve bench serve`: a load generator for any OpenAI-compatible server.

It sends streaming /v1/completions requests (chat datasets: /v1/chat/completions)
and measures what a user feels, with vLLM's definitions (`vllm bench serve`),
so the numbers compare:

    TTFT  time to first token: request sent -> first chunk with text
    ITL   inter-token latency: every gap between two chunks of a request; a
          chunk of k tokens (speculative decoding) counts as k gaps of 1/k each
    TPOT  time per output token, per request: (E2E - TTFT) / (output tokens - 1)
    E2E   request sent -> last chunk

Datasets: bench/serving/datasets.py (random, prefix-repetition, sharegpt, grounded,
open-chat). With speculative decoding on, the drafts' acceptance is read from
the server's spec-decode counters.

Arrivals: --request-rate R (Poisson, R per second) or inf (all at once),
capped by --max-concurrency. Before the run the server's prefix cache is
reset (POST /reset_prefix_cache) when it has that endpoint, and its hit rate
for the run is read from /metrics, as is (from pagedserve) the median engine
step time, so the ITL can be compared with what the engine itself took.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from tqdm.auto import tqdm

from bench.common.report import percentile, print_table
from bench.serving.datasets import DATASETS, Request
from clients.python import APIError, AsyncClient


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    input_len: int = 0


# -- one request ---------------------------------------------------------------------------
async def send(client: AsyncClient, model: str, request: Request,
               usage_per_chunk: bool = True) -> Result:
    """One streamed completion, timed at the client as each piece of text arrives.

    A chunk may carry several tokens (speculative decoding accepts drafts):
    with `usage_per_chunk` the server's running usage (vLLM's
    continuous_usage_stats) says how many, and the gap before the chunk
    counts as that many equal inter-token gaps, the latency a reader sees."""
    result = Result(input_len=request.input_len)
    chunks = seen = 0
    start = time.perf_counter()
    last = start
    options = {"include_usage": True, "continuous_usage_stats": True} if usage_per_chunk else None
    try:
        params = dict(model=model, max_tokens=request.output_len, temperature=0.0,
                      stream_options=options,
                      # exact output lengths (vLLM and llama.cpp both honour it)
                      ignore_eos=True if request.ignore_eos else None)
        if request.messages is not None:
            stream = await client.chat_stream(request.messages, **params)
        else:
            stream = await client.complete_stream(request.prompt, **params)
        async for _ in stream:
            now = time.perf_counter()
            tokens = stream.usage.completion_tokens if stream.usage else seen + 1
            new, seen = max(1, tokens - seen), max(tokens, seen + 1)
            if chunks == 0:
                result.ttft = now - start
            else:
                result.itl.extend([(now - last) / new] * new)
            last = now
            chunks += 1
    except APIError as exc:
        result.error = f"HTTP {exc.status}: {exc.message[:200]}"
        return result
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = last - start
    result.output_tokens = (stream.usage.completion_tokens if stream.usage else 0) or chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no tokens received"
    return result


async def run(args, requests: list[Request], model: str) -> tuple[list[Result], float]:
    semaphore = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)
    rng = random.Random(args.seed + 1)
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=args.quiet)

    # --lora-modules: request i runs under the i-th name in turn, so the
    # adapters share the load evenly (vLLM's benchmark picks one at random).
    models = args.lora_modules or [model]

    async def one(client, index, request):
        async with semaphore:
            result = await send(client, models[index % len(models)], request,
                                not args.no_usage_per_chunk)
        bar.update(1)
        return result

    # No retries: a refused request is a result to report, not to hide.
    async with AsyncClient(args.base_url, args.api_key, timeout=args.timeout,
                           max_retries=0) as client:
        tasks = []
        start = time.perf_counter()
        for index, request in enumerate(requests):
            tasks.append(asyncio.create_task(one(client, index, request)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return results, duration


# -- server side -------------------------------------------------------------------------
def server_counters(base_url: str, headers: dict) -> dict[str, float]:
    """Prefix-cache counters and engine-step histogram buckets from /metrics (if any)."""
    try:
        text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10).text
    except httpx.HTTPError:
        return {}
    values = {}
    for line in text.splitlines():
        if line.startswith(("pagedserve:prefix_cache_", "vllm:prefix_cache_",
                            "pagedserve:engine_step_seconds_bucket",
                            "pagedserve:spec_decode_num_", "vllm:spec_decode_num_")):
            name, value = line.rsplit(" ", 1)
            values[name.split(":", 1)[1]] = float(value)
    return values


def histogram_median(before: dict, after: dict, name: str) -> float | None:
    """Median of a Prometheus histogram over the run (bucket deltas, linear inside a bucket,
    as PromQL's histogram_quantile does)."""
    prefix = f'{name}_bucket{{le="'
    buckets = []
    for key, value in after.items():
        if key.startswith(prefix):
            bound = key[len(prefix):-2]
            buckets.append((float(bound), value - before.get(key, 0.0)))
    buckets.sort()
    if not buckets or buckets[-1][1] <= 0:
        return None
    half = buckets[-1][1] / 2
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= half:
            if bound == float("inf"):
                return lower_bound
            share = (half - lower_count) / (count - lower_count) if count > lower_count else 0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return None


def spec_decode_summary(before: dict, after: dict) -> dict | None:
    """Drafts, draft tokens and accepted tokens over the run (vLLM's counters),
    with the acceptance rate; None when the server drafted nothing."""
    def delta(name: str) -> float:
        key = f"spec_decode_num_{name}_total"
        return after.get(key, 0.0) - before.get(key, 0.0)

    drafts, drafted, accepted = delta("drafts"), delta("draft_tokens"), delta("accepted_tokens")
    if not drafts:
        return None
    return {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_per_draft": accepted / drafts}


def first_model(base_url: str, headers: dict) -> str:
    data = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30).json()["data"]
    return data[0]["id"]


# -- report -------------------------------------------------------------------------------
def summarize(values: list[float]) -> dict[str, float]:
    """Percentiles interpolate linearly between ranks, as `vllm bench serve` does."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    return {"mean": statistics.fmean(values), "median": statistics.median(values),
            "p90": percentile(values, 90), "p99": percentile(values, 99)}


def report(results: list[Result], duration: float, hit_rate: float | None) -> dict:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.input_len for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration else 0.0,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "prefix_cache_hit_rate": hit_rate,
        "ttft_s": summarize([r.ttft for r in ok]),
        "tpot_s": summarize(tpot),
        "itl_s": summarize([gap for r in ok for gap in r.itl]),
        "e2e_s": summarize([r.e2e for r in ok]),
    }


def print_summary(summary: dict) -> None:
    rows = [
        ("completed / failed", f"{summary['completed']} / {summary['failed']}"),
        ("duration (s)", f"{summary['duration_s']:.2f}"),
        ("request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("output throughput (tok/s)", f"{summary['output_throughput']:.1f}"),
        ("total throughput (tok/s)", f"{summary['total_token_throughput']:.1f}"),
    ]
    if summary["prefix_cache_hit_rate"] is not None:
        rows.append(("prefix cache hit rate", f"{summary['prefix_cache_hit_rate']:.1%}"))
    step = summary.get("server_engine_step_median_s")
    if step:
        rows.append(("server engine step median (ms)", f"{step * 1000:.1f}"))
        rows.append(("median ITL / engine step", f"{summary['itl_median_over_engine_step']:.2f}"))
    spec = summary.get("spec_decode")
    if spec:
        rows.append(("draft acceptance rate", f"{spec['acceptance_rate']:.1%}"))
        rows.append(("accepted tokens per draft", f"{spec['mean_accepted_per_draft']:.2f}"))
    print_table(["metric", "value"], rows)
    quantiles = ("mean", "median", "p90", "p99")
    print_table(["ms", *quantiles], [
        [key[:-2].upper(), *(f"{summary[key][q] * 1000:.1f}" for q in quantiles)]
        for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s")])
    for error in summary["errors"]:
        print(f"error: {error}")


def plot(results: list[Result], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    series = {"TTFT": [r.ttft for r in ok], "ITL": [g for r in ok for g in r.itl],
              "E2E": [r.e2e for r in ok]}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, (name, values) in zip(axes, series.items()):
        values = sorted(values)
        if values:
            ax.plot([v * 1000 for v in values], [(i + 1) / len(values) for i in range(len(values))])
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# -- command line ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="LoRA adapters the server serves (its --lora-modules names): the "
                        "requests take them in turn as their model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=sorted(DATASETS), default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON (sharegpt)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--sharegpt-max-output", type=int, default=256)
    p.add_argument("--chat-max-tokens", type=int, default=256,
                   help="max_tokens of the grounded and open-chat requests")
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="random token ids are drawn below this (most vocabularies are larger)")
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--no-reset-prefix-cache", action="store_true")
    p.add_argument("--no-usage-per-chunk", action="store_true",
                   help="do not ask for usage in every chunk (continuous_usage_stats, which "
                        "splits a chunk of several tokens into per-token gaps)")
    p.add_argument("--output", default=None, help="write the summary (and settings) as JSON")
    p.add_argument("--plot", default=None, help="write latency CDFs as PNG")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.dataset == "sharegpt" and not args.dataset_path:
        raise SystemExit("--dataset sharegpt needs --dataset-path")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or first_model(args.base_url, headers)
    rng = random.Random(args.seed)
    requests = DATASETS[args.dataset](args, rng, args.vocab_size)
    if not args.no_reset_prefix_cache:
        try:
            httpx.post(f"{args.base_url}/reset_prefix_cache", headers=headers, timeout=30)
        except httpx.HTTPError:
            pass  # another server may not have the endpoint
    before = server_counters(args.base_url, headers)
    results, duration = asyncio.run(run(args, requests, model))
    after = server_counters(args.base_url, headers)
    hit_rate = None
    queries = after.get("prefix_cache_queries_total", 0) - before.get("prefix_cache_queries_total", 0)
    if queries > 0:
        hits = after["prefix_cache_hits_total"] - before.get("prefix_cache_hits_total", 0)
        hit_rate = hits / queries
    summary = report(results, duration, hit_rate)
    summary["spec_decode"] = spec_decode_summary(before, after)
    step = histogram_median(before, after, "engine_step_seconds")
    summary["server_engine_step_median_s"] = step
    if step:
        summary["itl_median_over_engine_step"] = summary["itl_s"]["median"] / step
    print_summary(summary)
    if args.output:
        settings = {k: v for k, v in vars(args).items() if k != "api_key"}
        settings["request_rate"] = str(args.request_rate)
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(
            {"settings": settings, "model": model, "summary": summary,
             "per_request": [asdict(r) for r in results]}, indent=1))
    if args.plot:
        plot(results, args.plot)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
