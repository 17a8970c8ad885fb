"""What `bench prefix` makes of its runs: ideal prefill counts, comparisons,
tables and plots."""

from __future__ import annotations

from pathlib import Path

from bench.common.report import print_table
from bench.common.workload import Workload
from bench.offline.prefix_runs import Run


# -- what an ideal cache would compute -------------------------------------------------------
def unique_prompt_tokens(prompts: list[list[int]]) -> int:
    """Distinct (prefix, token) positions: what a token-exact cache would compute."""
    seen: set[int] = set()
    for prompt in prompts:
        h = 0
        for token in prompt:
            h = hash((h, token))
            seen.add(h)
    return len(seen)


def ideal_prefill_tokens(prompts: list[list[int]], block_size: int) -> int:
    """Prefill tokens a block-granular cache that never evicts would compute.

    Requests are taken in arrival order; a request reuses the full blocks of
    its prompt already computed by earlier requests (a chain from the first
    block), but always computes at least its last block, so there are logits
    to sample, as a real engine must.
    """
    cached: set[int] = set()
    total = 0
    for prompt in prompts:
        limit = (len(prompt) - 1) // block_size  # full blocks that may be hits
        h, hits, chain = 0, 0, True
        for b in range(len(prompt) // block_size):
            h = hash((h, tuple(prompt[b * block_size : (b + 1) * block_size])))
            if chain and b < limit and h in cached:
                hits += 1
            else:
                chain = False
            cached.add(h)
        total += len(prompt) - hits * block_size
    return total


# -- comparisons ----------------------------------------------------------------------------
def compare(off: Run, on: Run, workload: Workload) -> dict:
    decode = workload.num_decode_tokens
    ideal = (off.prefill_tokens_computed + decode) / max(1, on.prefill_tokens_computed + decode)
    prefill_share = off.prefill_tokens_computed and (
        on.prefill_tokens_computed / off.prefill_tokens_computed)
    calibrated_on = off.decode_step_seconds + off.prefill_step_seconds * prefill_share
    measured = on.output_tokens_per_s / off.output_tokens_per_s
    best = ideal_prefill_tokens(workload.prompts, on.block_size)
    calibrated = off.seconds / calibrated_on if calibrated_on else float("nan")
    return {
        "throughput_ratio_on_off": measured,
        "prefill_computed_ratio_off_on": off.prefill_tokens_computed
        / max(1, on.prefill_tokens_computed),
        "ideal_speedup": ideal,
        "measured_over_ideal": measured / ideal,
        # The same cost model with the fewest prefill tokens any block cache could compute.
        "perfect_cache_speedup": (off.prefill_tokens_computed + decode) / (best + decode),
        "calibrated_ideal_speedup": calibrated,
        "measured_over_calibrated": measured / calibrated if calibrated else float("nan"),
        "mean_ttft_ratio_off_on": off.mean_ttft_s / on.mean_ttft_s,
        # Engine time outside the model runner that caching adds (lookups, hashing, LRU),
        # as a share of the caching-off run: far less noisy than the throughput ratio.
        "engine_overhead_added": (on.engine_seconds - off.engine_seconds) / off.seconds,
        "outputs_identical": sum(
            a == b for a, b in zip(off.output_token_ids, on.output_token_ids)),
    }


def prefill_bound(workload: Workload, on: Run) -> dict:
    """Check: computed prefill with caching <= unique tokens + one block per request."""
    unique = unique_prompt_tokens(workload.prompts)
    limit = unique + workload.num_requests * on.block_size
    return {
        "unique_prompt_tokens": unique,
        "ideal_prefill_tokens": ideal_prefill_tokens(workload.prompts, on.block_size),
        "computed_with_caching": on.prefill_tokens_computed,
        "limit": limit,
        "ok": on.prefill_tokens_computed <= limit,
    }


# -- printing ----------------------------------------------------------------------------
RUN_COLUMNS = ["run", "bs", "seconds", "out tok/s", "req/s", "prefill", "hit rate", "TTFT s",
               "KV util", "evict"]


def print_runs(runs: list[Run], title: str | None = None) -> None:
    print_table(RUN_COLUMNS, [
        [r.label, r.block_size, f"{r.seconds:.1f}", f"{r.output_tokens_per_s:.1f}",
         f"{r.requests_per_s:.2f}", r.prefill_tokens_computed, f"{r.hit_rate:.1%}",
         f"{r.mean_ttft_s:.2f}", f"{r.kv_utilization:.1%}", r.evictions]
        for r in runs], title=title)


def print_comparison(name: str, cmp: dict) -> None:
    print(f"{name}: throughput on/off {cmp['throughput_ratio_on_off']:.2f}x, "
          f"prefill computed off/on {cmp['prefill_computed_ratio_off_on']:.2f}x, "
          f"ideal {cmp['ideal_speedup']:.2f}x (measured = {cmp['measured_over_ideal']:.0%} "
          f"of it), calibrated ideal {cmp['calibrated_ideal_speedup']:.2f}x "
          f"({cmp['measured_over_calibrated']:.0%}), mean TTFT off/on "
          f"{cmp['mean_ttft_ratio_off_on']:.2f}x, identical outputs {cmp['outputs_identical']}; "
          f"a perfect block cache would give {cmp['perfect_cache_speedup']:.2f}x")


def print_bound(bound: dict) -> None:
    verdict = "OK" if bound["ok"] else "NOT MET"
    print(f"prefill computed with caching {bound['computed_with_caching']} <= unique "
          f"{bound['unique_prompt_tokens']} + one block per request = {bound['limit']}: "
          f"{verdict} (ideal block-granular: {bound['ideal_prefill_tokens']})")


def print_no_reuse(off: Run, on: Run, cmp: dict, workload: Workload) -> None:
    print_runs([off, on], title=f"no reuse ({workload.num_requests} distinct prompts, "
                                f"{workload.num_prompt_tokens} prompt tokens)")
    loss = 1 - cmp["throughput_ratio_on_off"]
    print(f"caching on/off throughput {cmp['throughput_ratio_on_off']:.3f}x "
          f"(loss {loss:.1%}, negative = faster; target under 2 %); engine time outside "
          f"the model: off {off.engine_seconds:.2f} s, on {on.engine_seconds:.2f} s, "
          f"added {cmp['engine_overhead_added']:.2%} of the run")


# -- plots ----------------------------------------------------------------------------------
def write_plots(report: dict, plot_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    figures = [("prefix_caching_throughput.png", _throughput_figure(plt, report))]
    if report.get("block_size_sweep"):
        figures.append(("prefix_caching_block_sizes.png", _sweep_figure(plt, report)))
    paths = []
    for name, fig in figures:
        fig.tight_layout()
        fig.savefig(plot_dir / name, dpi=120)
        plt.close(fig)
        paths.append(str(plot_dir / name))
    return paths


def _throughput_figure(plt, report: dict):
    """Output tokens/s, caching off and on, side by side per section."""
    sections = [(name, report[key]) for name, key in
                (("shared prefix", "shared_prefix"), ("no reuse", "no_reuse")) if report.get(key)]
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.38
    for i, (_, section) in enumerate(sections):
        off, on = section["off"]["output_tokens_per_s"], section["on"]["output_tokens_per_s"]
        bars = ax.bar([i - width / 2, i + width / 2], [off, on], width,
                      color=["#9e9e9e", "#1f77b4"],
                      label=["caching off", "caching on"] if i == 0 else None)
        ax.bar_label(bars, fmt="%.1f")
    ax.set_xticks(range(len(sections)), [
        f"{name}\non/off {s['throughput_ratio_on_off']:.2f}x" for name, s in sections])
    ax.set_ylabel("output tokens/s")
    top = max(max(s["on"]["output_tokens_per_s"], s["off"]["output_tokens_per_s"])
              for _, s in sections)
    ax.set_ylim(0, top * 1.25)
    ax.set_title(f"Prefix caching off vs on\n{report['model'][:48]}, {report['device']}",
                 fontsize=10)
    ax.legend(loc="upper right")
    return fig


def _sweep_figure(plt, report: dict):
    """Throughput (left), hit rate and KV utilisation (right) per block size."""
    sweep = report["block_size_sweep"]
    sizes = [r["block_size"] for r in sweep]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(sizes, [r["output_tokens_per_s"] for r in sweep], "o-", label="caching on")
    off = report.get("shared_prefix", {}).get("off")
    if off:
        left.axhline(off["output_tokens_per_s"], color="#9e9e9e", ls="--",
                     label=f"caching off (bs {off['block_size']})")
    left.set_ylabel("output tokens/s")
    left.set_ylim(bottom=0)
    right.plot(sizes, [100 * r["hit_rate"] for r in sweep], "o-", label="hit rate")
    right.plot(sizes, [100 * r["kv_utilization"] for r in sweep], "s-", label="KV utilisation")
    right.set_ylabel("%")
    right.set_ylim(0, 105)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("block size (tokens)")
        ax.legend()
    fig.suptitle("Block-size sweep, shared-prefix workload, caching on")
    return fig
