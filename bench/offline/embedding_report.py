"""The embeddings benchmark's table: one row a shape and dtype, vLLM's figures
under it, then the profiles.

    print_report(cases, note, throughput_target=1.5, latency_target=1.0)
"""

from __future__ import annotations

from bench.common.report import print_table


def print_report(cases: list[dict], note: str, throughput_target: float,
                 latency_target: float) -> None:
    rows = [_row(c, throughput_target, latency_target) for c in cases]
    print_table(["model", "dtype", "tokens", "ours emb/s", "ST emb/s", "ratio", "",
                 "ours p50 ms", "ST p50 ms", "ratio", "", "pairs", "min cos"], rows, left=2,
                title="pagedserve vs sentence-transformers")
    print(f"  throughput ratio: median over the rounds' pairs, target >= {throughput_target}x; "
          f"p50 ratio: ours / theirs, target <= {latency_target}x (pairs: the median of the "
          f"repeats' pairs)")
    if note:
        print(f"  {note}")
    loads = [c["load_average"] for c in cases]
    print("  1-minute load average before/after each case: "
          + ", ".join(f"{a:.1f}/{b:.1f}" for a, b in loads)
          + " (other work on the machine lands on every system alike: they take turns)")
    for case in cases:
        if case["dtype"] == "float32" and case["min_cosine"] <= 0.999:
            print(f"  WARNING {case['title']}: vectors differ (min cosine "
                  f"{case['min_cosine']:.6f}): not the same computation")
        if "vllm" in case:
            _print_vllm(case)
    for case in cases:
        if "profile" in case:
            _print_profile(case)


def _row(c: dict, throughput_target: float, latency_target: float) -> list[str]:
    t, lat = c["throughput"], c["latency"]
    ours, base = c["systems"][:2]
    layers = c["settings"]["num_hidden_layers"]
    return [f"{c['title']} L{layers}", c["dtype"], f"{c['tokens']:,}",
            f"{t[ours]['embeddings_per_s']:.1f}", f"{t[base]['embeddings_per_s']:.1f}",
            f"{c['throughput_ratio']:.2f}x",
            "ok" if c["throughput_ratio"] >= throughput_target else "MISS",
            f"{lat[ours]['p50_ms']:.1f}", f"{lat[base]['p50_ms']:.1f}",
            f"{c['p50_ratio']:.2f}x", "ok" if c["p50_ratio"] <= latency_target else "MISS",
            f"{c['latency_ratio']:.2f}x", f"{c['min_cosine']:.6f}"]


def _print_profile(case: dict) -> None:
    p = case["profile"]
    print(f"\n  profile, {case['title']} {case['dtype']}: one LLM.embed of "
          f"{case['num_texts']} texts, {p['wall_ms']:.0f} ms wall, ops' self time "
          f"{p['ops_ms']:.0f} ms")
    print_table(["op", "self ms", "calls", "of wall"],
                [[e["op"], f"{e['self_ms']:.1f}", e["calls"], f"{e['share_of_wall']:.1%}"]
                 for e in p["top"]], left=1)


def _print_vllm(case: dict) -> None:
    v = case["vllm"]
    if "error" in v:
        print(f"  vLLM ({v['dtype']}, {case['title']}): failed: {v['error']}")
        return
    ours, vllm = case["systems"][0], "vllm"
    rates, latency = v["throughput"], v["latency"]
    print(f"  vLLM {v['version']} ({v['dtype']}, {case['title']}, same rounds): "
          f"{rates[vllm]['embeddings_per_s']:.1f} emb/s, p50 {latency[vllm]['p50_ms']:.1f} ms; "
          f"ours / vLLM: throughput {v['throughput_ratio']:.2f}x, p50 {v['p50_ratio']:.2f}x; "
          f"vLLM / ST throughput {v['baseline']['throughput_ratio']:.2f}x; "
          f"min cosine vs ST {v['min_cosine']:.6f}")
