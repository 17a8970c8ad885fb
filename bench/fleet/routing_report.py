"""What `bench fleet --routing` reports: the ideal hit rate, each mode's numbers, the targets.

The ideal (the oracle): a fleet with unlimited KV cache that sends every request
to the replica holding the longest prefix of its prompt. A request's ideal cached
tokens are the longest prefix of its prompt's token ids (from the replica's
/v1/chat/completions/render, the serving path's own tokens) that

- any request sent before it in the same run had in its prompt (counted even if
  that one's prefill was still running: an upper bound), or
- its own previous turn had computed: that prompt and the answer's tokens but
  the last (the answer's tokens read from this prompt, which quotes it),

in whole blocks, and at most the prompt less one token (the engine computes the
last prompt token again to sample from it). The hit rate of ideal is the mode's
cached prompt tokens (from each answer's usage) over the ideal's, summed over
the run's successful requests.
"""

from __future__ import annotations

import os

from bench.common.report import percentile, print_table

TARGET_HIT_OF_IDEAL = 0.90
TARGET_P90_VS_ROUND_ROBIN = 1 / 5
TARGET_MAX_SHARE = 1.5


def common_prefix(a: list[int], b: list[int]) -> int:
    return len(os.path.commonprefix([a, b]))


def ideal_cached(records: list[dict], block_size: int) -> list[int]:
    """Each record's ideal cached tokens (see the module's docstring).

    A record has `tokens`, `sent`, `conversation`, `turn`, `prompt_tokens`,
    `completion_tokens` and `error`; failed records count for nothing.
    """
    by_turn = {(r["conversation"], r["turn"]): r for r in records if not r["error"]}
    ideal = []
    for r in records:
        if r["error"]:
            ideal.append(0)
            continue
        best = max((common_prefix(r["tokens"], o["tokens"]) for o in records
                    if o is not r and not o["error"] and o["sent"] < r["sent"]), default=0)
        previous = by_turn.get((r["conversation"], r["turn"] - 1))
        if previous and r["tokens"][:len(previous["tokens"])] == previous["tokens"]:
            best = max(best, previous["prompt_tokens"] + previous["completion_tokens"] - 1)
        ideal.append(min(best, r["prompt_tokens"] - 1) // block_size * block_size)
    return ideal


def summarize(mode: str, records: list[dict], per_replica: list[int], block_size: int) -> dict:
    """One mode's numbers from its records (with `tokens`) and each replica's request count."""
    ideal = ideal_cached(records, block_size)
    ok = [r for r in records if not r["error"]]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    ideal_total = sum(ideal)
    ttfts = [r["ttft"] for r in ok]
    started = min((r["sent"] for r in records), default=0.0)
    ended = max((r["sent"] + r["e2e"] for r in records), default=0.0)
    output = sum(r["completion_tokens"] for r in ok)
    share = sum(per_replica) / max(1, len(per_replica))
    return {
        "mode": mode, "requests": len(ok), "failed": len(records) - len(ok),
        "prompt_tokens": prompt, "cached_tokens": cached, "ideal_cached_tokens": ideal_total,
        "hit_rate": cached / max(1, prompt), "hit_of_ideal": cached / max(1, ideal_total),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
        "output_tokens": output, "seconds": ended - started,
        "output_tokens_per_s": output / max(1e-9, ended - started),
        "per_replica": per_replica, "max_share": max(per_replica, default=0) / max(1e-9, share),
        "token_count_mismatches": sum(len(r["tokens"]) != r["prompt_tokens"] for r in ok),
        "requests_detail": [{k: v for k, v in r.items() if k != "tokens"} | {"ideal_cached": i}
                            for r, i in zip(records, ideal)],
    }


def targets(modes: dict[str, dict]) -> dict:
    """The issue's targets for kv_aware, each with its value and whether it is met
    (None where a mode it compares with did not run)."""
    kv, rr, nginx = modes.get("kv_aware"), modes.get("round_robin"), modes.get("nginx")
    if kv is None:
        return {}
    found = {"hit_of_ideal_at_least_90pct": (kv["hit_of_ideal"],
                                             kv["hit_of_ideal"] >= TARGET_HIT_OF_IDEAL),
             "max_share_at_most_1.5": (kv["max_share"], kv["max_share"] <= TARGET_MAX_SHARE)}
    if rr is not None:
        ratio = kv["ttft_p90_s"] / max(1e-9, rr["ttft_p90_s"])
        found["p90_ttft_at_most_fifth_of_round_robin"] = (ratio,
                                                          ratio <= TARGET_P90_VS_ROUND_ROBIN)
    if nginx is not None:
        ratio = kv["ttft_p90_s"] / max(1e-9, nginx["ttft_p90_s"])
        found["p90_ttft_at_most_nginx"] = (ratio, ratio <= 1.0)
    return {name: {"value": value, "met": met} for name, (value, met) in found.items()}


def print_report(report: dict) -> None:
    w = report["workload"]
    rows = [[m["mode"], str(m["requests"]), str(m["failed"]), f"{m['hit_rate']:.1%}",
             f"{m['hit_of_ideal']:.1%}", f"{m['ttft_p50_s']:.2f}", f"{m['ttft_p90_s']:.2f}",
             f"{m['output_tokens_per_s']:.1f}", "/".join(str(c) for c in m["per_replica"]),
             f"{m['max_share']:.2f}"] for m in report["modes"]]
    print_table(["mode", "requests", "failed", "hit rate", "of ideal", "TTFT p50 s",
                 "TTFT p90 s", "out tok/s", "per replica", "max/share"], rows,
                title=f"{w['replicas']} replicas, {w['tenants']} tenants "
                      f"(first turns ~{w['first_turn_prompt_tokens_mean']:.0f} tokens), "
                      f"{w['conversations']} conversations × {w['turns']} turns, "
                      f"{w['rate']}/s")
    for name, target in report["targets"].items():
        print(f"kv_aware {name}: {target['value']:.3f} -> "
              f"{'met' if target['met'] else 'NOT met'}")
