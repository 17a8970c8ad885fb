"""Smoke tests of the benchmarks: they run end to end on the tiny model and write
sane JSON. Timings are never asserted (shared CI machines are noisy)."""

from __future__ import annotations

import json

import pytest

from bench.offline import prefix_caching, structured, throughput
from bench.offline.prefix_report import ideal_prefill_tokens, unique_prompt_tokens

TINY_ENGINE = ["--kv-cache-memory-bytes", str(1 << 22), "--device", "cpu"]


@pytest.fixture(scope="module")
def prefix_report(tiny_llama_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-prefix")
    # A small token budget spreads admission over several steps, so later requests
    # find the system prompts that earlier ones computed.
    argv = [
        "--model", str(tiny_llama_path), *TINY_ENGINE, "--max-num-batched-tokens", "64",
        "--num-requests", "4", "--system-len", "32", "--question-len", "8:8",
        "--output-len", "2", "--sweep-block-sizes", "8,16",
        "--output", str(out / "prefix.json"), "--plot-dir", str(out),
    ]
    assert prefix_caching.main(argv) == 0
    return json.loads((out / "prefix.json").read_text()), out


def test_prefix_report_has_every_section(prefix_report):
    report, out = prefix_report
    for key in ("model", "dtype", "cost_model", "workload", "shared_prefix",
                "block_size_sweep", "no_reuse", "plots"):
        assert key in report, key
    workload = report["workload"]
    assert workload["prompt_tokens"] == 4 * (32 + 8)
    assert workload["output_tokens"] == 4 * 2
    for section in ("shared_prefix", "no_reuse"):
        for key in ("off", "on", "throughput_ratio_on_off", "ideal_speedup",
                    "prefill_computed_ratio_off_on"):
            assert key in report[section], (section, key)
        for run in (report[section]["off"], report[section]["on"]):
            assert run["seconds"] > 0 and run["output_tokens_per_s"] > 0
            assert run["mean_ttft_s"] > 0 and 0 < run["kv_utilization"] <= 1
            # the runner is timed through the engine's seam; the rest is the engine's
            assert 0 < run["runner_seconds"] < run["seconds"] and run["engine_seconds"] > 0
    assert [r["block_size"] for r in report["block_size_sweep"]] == [8, 16]
    for path in report["plots"]:
        assert path.endswith(".png") and (out / path.rsplit("/", 1)[-1]).stat().st_size > 0


def test_prefix_caching_saves_prefill(prefix_report):
    report, _ = prefix_report
    shared = report["shared_prefix"]
    off, on = shared["off"], shared["on"]
    assert off["prefix_caching"] is False and on["prefix_caching"] is True
    assert off["hit_rate"] == 0 and off["prefix_cache_hits"] == 0
    assert off["prefill_tokens_computed"] == report["workload"]["prompt_tokens"]
    assert on["hit_rate"] > 0
    assert on["cached_tokens_reported"] == on["prefix_cache_hits"]
    assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"]
    assert on["prefill_tokens_computed"] + on["prefix_cache_hits"] == on["prefix_cache_queries"]
    assert shared["prefill_computed_ratio_off_on"] > 1 and shared["ideal_speedup"] > 1
    bound = shared["prefill_bound"]
    assert bound["ideal_prefill_tokens"] <= bound["unique_prompt_tokens"] + 4 * 16
    assert shared["outputs_identical"] == 4  # greedy: caching must not change the tokens
    for run in report["block_size_sweep"]:
        assert run["prefix_caching"] and 0 < run["hit_rate"] < 1


def test_no_reuse_has_no_hits(prefix_report):
    report, _ = prefix_report
    no_reuse = report["no_reuse"]
    assert no_reuse["on"]["hit_rate"] == 0 and no_reuse["off"]["hit_rate"] == 0
    assert no_reuse["on"]["prefill_tokens_computed"] == no_reuse["prompt_tokens"]


def test_ideal_prefill_tokens_counts_full_blocks_only():
    system = list(range(100, 120))  # 20 tokens: 2 full blocks of 8 and 4 left over
    prompts = [system + [1, 2, 3], system + [4, 5, 6], list(range(200, 208))]
    # second prompt reuses 16 tokens; the third (exactly one block) shares nothing
    assert ideal_prefill_tokens(prompts, 8) == 23 + (23 - 16) + 8
    assert unique_prompt_tokens(prompts) == 23 + 3 + 8
    # an identical prompt still computes its last block
    assert ideal_prefill_tokens([system[:16], system[:16]], 8) == 16 + 8


def test_throughput_bench_smoke(tiny_llama_path, tmp_path):
    """Both workloads, a handful of requests: every section of the JSON is there and sane."""
    out = tmp_path / "throughput.json"
    argv = [
        "--model", str(tiny_llama_path), *TINY_ENGINE, "--workload", "both", "--num-prompts", "3",
        "--chat-input-len", "4:12", "--chat-output-len", "2:6",
        "--prefill-input-len", "24:40", "--prefill-output-len", "3:3",
        "--hf-batch-sizes", "2", "--hf-sort", "both", "--matmul-tokens", "16,32",
        "--output", str(out),
    ]
    assert throughput.main(argv) == 0
    report = json.loads(out.read_text())
    for key in ("model", "dtype", "device", "engine_config", "hf", "machine", "matmul",
                "flop_formula", "workloads"):
        assert key in report, key
    assert report["engine_config"]["max_model_len"] == 1024  # the tiny model's own limit
    assert report["machine"]["torch_threads"] >= 1 and report["machine"]["torch_parallel_info"]
    assert report["matmul"]["best_gflops"] > 0
    assert set(report["workloads"]) == {"chat", "prefill-heavy"}
    for name, w in report["workloads"].items():
        settings = w["settings"]
        assert settings["num_prompts"] == 3 and settings["ignore_eos"]
        if name == "chat":
            assert 3 * 2 <= settings["output_tokens"] <= 3 * 6
        else:
            assert settings["output_tokens"] == 3 * 3
            assert 3 * 24 <= settings["prompt_tokens"] <= 3 * 40
        flops = w["flops"]
        assert flops["tokens_fed"] == settings["prompt_tokens"] + settings["output_tokens"] - 3
        assert flops["total"] == flops["linear"] + flops["lm_head"] + flops["attention"] > 0
        assert w["floor_seconds"] > 0
        # pagedserve, then HF batch 2 length-sorted and in arrival order
        runs = [w["pagedserve"], *w["hf"]]
        assert [r["system"] for r in runs] == ["pagedserve", "HF generate", "HF generate"]
        assert [r["extra"]["sorted"] for r in w["hf"]] == [True, False]
        for r in runs:
            assert r["seconds"] > 0 and r["output_tokens_per_s"] > 0
            assert r["total_tokens_per_s"] > r["output_tokens_per_s"]
            assert r["fraction_of_floor"] > 0
            assert r["peak_memory_bytes"] >= 0 and r["extra"]["memory"]["method"]
        assert w["hf_best"] == w["hf"][w["hf_best_index"]]
        assert w["hf_best"]["output_tokens_per_s"] == max(r["output_tokens_per_s"]
                                                          for r in w["hf"])
        assert w["ratio_vs_best_hf"] > 0 and w["memory_ratio_vs_best_hf"] > 0
        extra = w["pagedserve"]["extra"]
        assert extra["preemptions"] == 0 and extra["steps"] > 0
        kv = extra["kv_utilization"]
        assert 0 < kv["contiguous"] <= kv["paged"] <= 1
        assert kv["samples"] > 0 and 1 <= kv["max_running_seqs"] <= 3
        assert kv["kv_slots"] == extra["kv_blocks"] * extra["block_size"]
        assert kv["contiguous_seqs_fit"] == kv["kv_slots"] // 1024
        assert kv["paged_seqs_fit"] >= kv["paged_seqs_fit_whole_blocks"] > kv["contiguous_seqs_fit"]


def test_bench_serve_against_a_live_server(tiny_llama_path, tmp_path):
    """The load generator measures a real server: every request completes, the
    JSON has vLLM's metrics, and the prefix-repetition run reads a hit rate."""
    from bench.serving import serve
    from live_server import run_server, tiny_config

    with run_server(tiny_config(tiny_llama_path)) as live:
        out = tmp_path / "serve.json"
        argv = ["--base-url", live.url, "--dataset", "random", "--num-prompts", "6",
                "--random-input-len", "16", "--random-output-len", "5",
                "--max-concurrency", "3", "--output", str(out), "--plot",
                str(tmp_path / "cdf.png"), "--quiet"]
        assert serve.main(argv) == 0
        report = json.loads(out.read_text())
        summary = report["summary"]
        assert summary["completed"] == 6 and summary["failed"] == 0
        assert summary["total_output_tokens"] == 6 * 5  # ignore_eos: exact lengths
        assert summary["total_input_tokens"] == 6 * 16
        for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            assert set(summary[key]) == {"mean", "median", "p90", "p99"}
            assert 0 < summary[key]["median"] <= summary[key]["p99"]
        assert len(report["per_request"]) == 6
        assert (tmp_path / "cdf.png").stat().st_size > 0
        # The server exports its engine step time; the ITL is compared with it.
        assert summary["server_engine_step_median_s"] > 0
        assert summary["itl_median_over_engine_step"] > 0

        argv = ["--base-url", live.url, "--dataset", "prefix-repetition", "--num-prompts", "8",
                "--num-prefixes", "2", "--prefix-len", "64", "--suffix-len", "8",
                "--output-len", "3", "--max-concurrency", "2", "--quiet",
                "--output", str(out)]
        assert serve.main(argv) == 0
        summary = json.loads(out.read_text())["summary"]
        assert summary["completed"] == 8
        # 2 prefixes of 4 full 16-token blocks, each computed once then reused.
        assert summary["prefix_cache_hit_rate"] > 0.5


def test_histogram_median_interpolates_like_promql():
    from bench.serving.serve import histogram_median

    name = "engine_step_seconds"
    key = lambda le: f'{name}_bucket{{le="{le}"}}'  # noqa: E731
    before = {key("0.1"): 1.0, key("0.2"): 1.0, key("+Inf"): 1.0}
    after = {key("0.1"): 3.0, key("0.2"): 7.0, key("+Inf"): 9.0}
    # 8 new samples: 2 in (0, 0.1], 4 in (0.1, 0.2], 2 above; the 4th sits halfway in the second.
    assert abs(histogram_median(before, after, name) - 0.15) < 1e-9
    assert histogram_median(after, after, name) is None


def test_structured_bench_smoke(tiny_llama_path, tmp_path):
    """Both runs and the compile times are reported; the constrained run masked steps."""
    out = tmp_path / "structured.json"
    argv = ["--model", str(tiny_llama_path), *TINY_ENGINE, "--requests", "4",
            "--output-len", "8", "--output", str(out)]
    assert structured.main(argv) == 0
    report = json.loads(out.read_text())
    plain, mixed = report["runs"]
    assert (plain["constrained"], mixed["constrained"]) == (False, True)
    assert plain["output_tokens"] == 4 * 8 and plain["mask_steps"] == 0
    assert 2 * 8 < mixed["output_tokens"] <= 4 * 8 and mixed["mask_steps"] > 0
    assert 0 < mixed["mask_ms_median"] <= mixed["mask_ms_max"]
    assert set(report["compile_ms"]) == {"vocabulary", *structured.SCHEMAS}
    assert all(ms > 0 for ms in report["compile_ms"].values())
