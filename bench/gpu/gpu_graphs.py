"""CUDA graphs for the decode step on a GPU (engine/model/cuda_graphs.py): parity,
one-stream latency against the HBM floor, throughput.

    python -m bench.gpu.gpu_graphs --output OUT/graphs.json    (a CUDA machine: ~3-4 min on an H100)
    python -m bench.gpu.gpu_graphs --device cpu --small        (anywhere: the script's smoke run;
                                                            the CPU has no graphs, both sides eager)

parity      float32, greedy, three engines: enforce_eager=True, False, and False with
            async_scheduling (engine/frontend/async_step.py). bench.gpu.gpu_check's
            random Llama (16 / 4 heads, head_dim 64, 8 layers), 32 tokens per prompt, in
            batches of 1, 3 and 17 prompts (3 and 17 replay the graphs of sizes 4 and
            24), and 17 prompts ending at 8..40 tokens (the batch shrinks through padded
            and exact sizes); then a random Gemma 3 whose sliding layers have their own
            KV pool (the window buffers), 5 prompts past its window. Token for token
            (eager = graphs = graphs + async); also vLLM's near-tie rule (tests/hf_compare.py)
            and the largest difference of a chosen token's logprob.
itl         one stream at Llama-3.1-8B's shape (scripts/make_shape_folder.py, random
            weights, bf16): ms per output token, (N tokens - 1 token) / (N - 1), best of
            3, with the graphs, graphs + async and eager (the same engine: graphs set aside,
            async steps set up or aside), against the HBM floor = (bytes a decode step
            reads: every weight but the untied embedding's, the KV of the mean context) /
            copy bandwidth (bench/kernels/kernel_timing.py). Also one bs-1 graph replay alone
            (and its kernels' GPU time by kind) and the linear layers alone at one row
            (cuBLAS, and the runner's own product), so
            the gap splits into the forward's small kernels and the engine's step.
throughput  64 and 256 streams of random 512-token prompts, 256 tokens each, ignore_eos,
            graphs, graphs + async scheduling and eager on the same engine: output tokens/s.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench.gpu.gpu_check import build_model, make_prompts
from bench.gpu.step_profile import linear_ms, replay_ms
from bench.kernels.kernel_timing import copy_bandwidth_gbps, make_timer
from tests.hf_compare import TOP_K, compare

ROOT = Path(__file__).resolve().parents[2]
ITL_TARGET = 1.25  # issue #42: one stream within 1.25x the HBM floor


def release_memory() -> None:
    """After the last reference to an engine is gone: its memory back to the device
    before the next engine profiles."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def greedy(llm, prompts, max_tokens) -> list:
    """(token ids, top logprobs per position) of each prompt; max_tokens one per prompt."""
    from engine import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=TOP_K)
              for n in max_tokens]
    llm.reset_prefix_cache()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [dict(t) for t in o.outputs[0].top_logprobs])
            for o in outputs]


def parity_cases(vocab: int, small: bool) -> list[tuple[str, list, list]]:
    """(name, prompts, max_tokens per prompt)."""
    rng = random.Random(1)
    longest = 40 if small else 600
    lengths17 = [rng.randrange(1, longest) for _ in range(17)]
    shapes = [("batch 1", [longest + 100], [32]),
              ("batch 3 (graph 4)", [5, 130 % longest, longest], [32] * 3),
              ("batch 17 (graph 24)", lengths17, [32] * 17),
              ("17 ending at 8..40 tokens", lengths17[::-1], [8 + 2 * i for i in range(17)])]
    return [(name, make_prompts(vocab, lengths, seed=i), tokens)
            for i, (name, lengths, tokens) in enumerate(shapes)]


def judge(eager, graphs) -> dict:
    """Token-for-token agreement, the near-tie rule, the chosen tokens' logprob gap."""
    identical = sum(e[0] == g[0] for e, g in zip(eager, graphs))
    gap = 0.0
    for (ids, tops), (other_ids, other_tops) in zip(eager, graphs):
        for token, a, b, other in zip(ids, tops, other_tops, other_ids):
            if token == other and token in a and token in b:
                gap = max(gap, abs(a[token] - b[token]))
    return {"prompts": len(eager), "identical": identical, "ok": identical == len(eager),
            "near_tie_rule": compare(eager, graphs), "max_logprob_diff": gap}


def run_both(folder: Path, cases, engine_args: dict) -> tuple[list[dict], dict]:
    """Every case through an eager engine, one with graphs, one with graphs + async."""
    from engine import LLM

    results, graph_info = {}, {}
    for name, eager, overlap in (("eager", True, False), ("graphs", False, False),
                                 ("async", False, True)):
        llm = LLM(str(folder), enforce_eager=eager, async_scheduling=overlap, **engine_args)
        results[name] = [greedy(llm, prompts, tokens) for _, prompts, tokens in cases]
        graphs = llm.engine.runner.graphs
        if graphs is not None and not overlap:
            graph_info = {"sizes": graphs.sizes, "replays": graphs.replays,
                          "pool_mib": graphs.pool_bytes / 2**20,
                          "reserved_mib": graphs.reserved_bytes / 2**20}
        if overlap:
            graph_info["async_overlapped_steps"] = llm.engine.overlap.num_overlapped
        del llm, graphs
        release_memory()
    rows = [{"case": name, **judge(e, g), **{f"async_{key}": value for key, value in judge(e, a).items()
                                             if key in ("identical", "ok", "max_logprob_diff")}}
            for (name, _, _), e, g, a in zip(cases, *results.values())]
    return rows, graph_info


def gemma3_folder(folder: Path, small: bool) -> Path:
    """A random Gemma 3: 3 sliding layers (window 64) and a global one, head_dim 64."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=512 if small else 8192, hidden_size=256, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        query_pre_attn_scalar=64, sliding_window=64, max_position_embeddings=2048,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], initializer_range=0.1,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        architectures=["Gemma3ForCausalLM"])
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def parity(device: str, small: bool) -> dict:
    common = {"device": device, "dtype": "float32", "max_model_len": 2048, "max_num_seqs": 32,
              "gpu_memory_utilization": 0.4}
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp) / "llama", small)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        rows, graphs = run_both(folder, parity_cases(vocab, small), common)
        gemma = gemma3_folder(Path(tmp) / "gemma3", small)
        lengths = [30, 70, 150, 200, 90] if not small else [10, 70, 20, 90, 40]
        cases = [("gemma 3, window pool", make_prompts(512 if small else 8192, lengths, 7),
                  [24 - 4 * (i == 1) for i in range(5)])]
        hybrid, hybrid_graphs = run_both(gemma, cases, common)
    replayed = bool(graphs.get("replays")) and bool(hybrid_graphs.get("replays"))
    return {"cases": rows + hybrid, "graphs": graphs, "hybrid_graphs": hybrid_graphs,
            "graphs_replayed": replayed,  # else the parity is eager against eager
            "ok": all(row["ok"] and row["async_ok"] for row in rows + hybrid)
            and (replayed or device == "cpu") and bool(graphs.get("async_overlapped_steps"))}


@contextlib.contextmanager
def eager_steps(llm, eager: bool):
    """The engine with its graphs set aside (every step eager) while eager is True."""
    runner = llm.engine.runner
    graphs = runner.graphs
    if eager:
        runner.graphs = None
    try:
        yield
    finally:
        runner.graphs = graphs


@contextlib.contextmanager
def async_steps(llm, overlap: bool):
    """The engine with async scheduling on (or off) for a while, the same weights."""
    from engine.frontend.async_step import AsyncSteps
    engine = llm.engine
    saved, engine.overlap = engine.overlap, AsyncSteps.build(engine) if overlap else None
    try:
        yield
    finally:
        engine.overlap = saved


def shape_folder(folder: Path, shape: str, small: bool) -> Path:
    """config.json of a real model's shape (scripts/make_shape_folder.py), no weights."""
    if small:
        return build_model(folder, small=True)
    spec = importlib.util.spec_from_file_location("make_shape_folder",
                                                  ROOT / "scripts" / "make_shape_folder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make_config(shape).save_pretrained(folder)
    return folder


def time_tokens(llm, prompt: list[int], tokens: int, repeats: int) -> float:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        best = min(best, time.perf_counter() - started)
        assert len(out.outputs[0].token_ids) == tokens
    return best


def itl_ms(llm, prompt: list[int], tokens: int, eager: bool, overlap: bool = False) -> float:
    """ms per output token of one stream: (N tokens - 1 token) / (N - 1), best of 3 each."""
    with eager_steps(llm, eager), async_steps(llm, overlap):
        time_tokens(llm, prompt, 8, 1)  # warm-up: compiles, first-touch allocations
        many = time_tokens(llm, prompt, tokens, 3)
        one = time_tokens(llm, prompt, 1, 3)
    return (many - one) / (tokens - 1) * 1e3


def read_bytes(runner, context: float) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step of one sequence reads: every parameter
    but an untied embedding (it reads one row), and the K/V of `context` tokens."""
    model = runner.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        embedding = model.embed_tokens.weight
        weights -= embedding.numel() * embedding.element_size()
    return weights, int(context * runner.bytes_per_block() / runner.block_size)


def one_stream(llm, device, bandwidth: float, tokens: int) -> dict:
    runner = llm.engine.runner
    rng, vocab = random.Random(0), runner.model.args.vocab_size
    prompt = [rng.randrange(100, min(vocab, 30000)) for _ in range(128)]
    graphs, eager = itl_ms(llm, prompt, tokens, False), itl_ms(llm, prompt, tokens, True)
    try:  # async's first run on a device: its failure must not take the rest with it
        overlapped, async_error = itl_ms(llm, prompt, tokens, False, overlap=True), None
    except Exception:  # noqa: BLE001
        overlapped, async_error = float("nan"), traceback.format_exc()
    context = len(prompt) + tokens / 2
    weights, kv = read_bytes(runner, context)
    floor = (weights + kv) / (bandwidth * 1e9) * 1e3
    timer = make_timer(torch.device(device))
    replay, profile = replay_ms(runner, int(context), timer)
    return {"prompt_tokens": len(prompt), "output_tokens": tokens, "itl_graphs_ms": graphs,
            "itl_eager_ms": eager, "eager_over_graphs": eager / graphs,
            "itl_graphs_async_ms": overlapped, "graphs_over_graphs_async": graphs / overlapped,
            "async_error": async_error,
            "weights_read_gb": weights / 1e9, "kv_read_gb": kv / 1e9, "floor_ms": floor,
            "graphs_over_floor": graphs / floor, "graphs_async_over_floor": overlapped / floor,
            "target": ITL_TARGET, "within_target": min(graphs, overlapped) / floor <= ITL_TARGET,
            "replay_bs1_ms": replay,
            "replay_bs1_profile": profile,
            "linear_layers_bs1_ms": linear_ms(runner.model, timer, device),
            "linear_layers_bs1_runner_ms": linear_ms(runner.model, timer, device,
                                                     runner.kernels.linear)}


def throughput(llm, streams: int, prompt_len: int, out_len: int, with_eager: bool = True) -> dict:
    from engine import SamplingParams

    vocab = llm.engine.runner.model.args.vocab_size
    rng = random.Random(streams)
    prompts = [{"prompt_token_ids": [rng.randrange(100, min(vocab, 30000))
                                     for _ in range(prompt_len)]} for _ in range(streams)]
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    row = {"streams": streams, "prompt_tokens": prompt_len, "output_tokens": out_len}
    for name, eager, overlap in (("graphs", False, False), ("eager", True, False),
                                 ("graphs_async", False, True)):
        if eager and not with_eager:
            continue
        try:
            with eager_steps(llm, eager), async_steps(llm, overlap):
                llm.generate(prompts[:8], warm, use_tqdm=False)
                llm.reset_prefix_cache()
                started = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - started
        except Exception:  # noqa: BLE001  one side's failure keeps the others' rows
            row[f"{name}_error"], row[f"{name}_seconds"] = traceback.format_exc(), float("nan")
            row[f"{name}_tok_s"] = float("nan")
            continue
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        row[f"{name}_seconds"], row[f"{name}_tok_s"] = seconds, produced / seconds
    if with_eager:
        row["eager_over_graphs"] = row["eager_seconds"] / row["graphs_seconds"]
    row["graphs_over_graphs_async"] = row["graphs_seconds"] / row["graphs_async_seconds"]
    return row


def speed(args) -> dict:
    """The itl and throughput parts on one engine at the named shape."""
    from engine import LLM

    device = torch.device(args.device)
    bandwidth = copy_bandwidth_gbps(device, make_timer(device), 1 << 30 if not args.small else 1 << 24)
    with tempfile.TemporaryDirectory() as tmp:
        folder = shape_folder(Path(tmp), args.shape, args.small)
        started = time.perf_counter()
        llm = LLM(str(folder), device=args.device, load_format="dummy",
                  dtype="float32" if args.small else "bfloat16", max_num_seqs=max(args.streams))
        report = {"shape": "tiny" if args.small else args.shape, "copy_gbps": bandwidth,
                  "engine_start_seconds": time.perf_counter() - started}
        graphs = llm.engine.runner.graphs
        if graphs is not None:
            report["graphs"] = {"sizes": len(graphs.sizes), "largest": graphs.sizes[-1],
                                "capture_seconds": graphs.capture_seconds,
                                "pool_mib": graphs.pool_bytes / 2**20,
                                "reserved_mib": graphs.reserved_bytes / 2**20}
        report["itl"] = one_stream(llm, args.device, bandwidth, args.itl_tokens)
        report["throughput"] = [throughput(llm, n, args.prompt_len, args.output_len,
                                           not args.no_eager_throughput) for n in args.streams]
        if graphs is not None:
            report["graphs"]["replays"] = graphs.replays
        del llm, graphs
        release_memory()
    return report


def summary(report: dict) -> list[str]:
    lines = []
    for row in report.get("parity", {}).get("cases", []):
        lines.append(f"parity {row['case']}: {row['identical']}/{row['prompts']} identical, "
                     f"max logprob diff {row['max_logprob_diff']:.2e}; graphs + async "
                     f"{row['async_identical']}/{row['prompts']}, ok {row['async_ok']}")
    if "graphs_replayed" in report.get("parity", {}):
        lines.append(f"parity: graphs replayed {report['parity']['graphs_replayed']}, "
                     f"ok {report['parity']['ok']}")
    speed_part = report.get("speed", {})
    if "shape" in speed_part:
        lines.append(f"{speed_part['shape']} graphs: {speed_part.get('graphs', 'none (eager)')}")
    if "itl" in speed_part:
        itl = speed_part["itl"]
        replay = itl["replay_bs1_ms"]
        replay = "n/a" if replay is None else f"{replay:.2f}"
        lines.append(
            f"1 stream {speed_part['shape']}: graphs {itl['itl_graphs_ms']:.2f} ms, eager "
            f"{itl['itl_eager_ms']:.2f} ms ({itl['eager_over_graphs']:.2f}x); floor "
            f"{itl['floor_ms']:.2f} ms at {speed_part['copy_gbps']:.0f} GB/s: graphs/floor "
            f"{itl['graphs_over_floor']:.3f} (target <= {ITL_TARGET}); replay alone "
            f"{replay} ms, linear layers alone {itl['linear_layers_bs1_ms']:.2f} ms (cuBLAS), "
            f"{itl['linear_layers_bs1_runner_ms']:.2f} ms (the runner's); graphs + async "
            f"{itl['itl_graphs_async_ms']:.2f} ms: {itl['graphs_async_over_floor']:.3f} x floor")
        profile = itl.get("replay_bs1_profile")
        if profile:
            lines.append(f"bs-1 replay kernels: {profile['kernels_per_call']:.0f} a step, "
                         f"{profile['gpu_us_per_call']:.0f} us of GPU time: " + ", ".join(
                             f"{kind} {us:.0f}" for kind, us in profile["by_kind_us"].items()))
    for row in speed_part.get("throughput", []):
        eager = (f", eager {row['eager_tok_s']:.0f} tok/s (eager/graphs time {row['eager_over_graphs']:.2f})"
                 if "eager_tok_s" in row else "")
        lines.append(f"{row['streams']} streams: graphs {row['graphs_tok_s']:.0f} tok/s, graphs + async "
                     f"{row['graphs_async_tok_s']:.0f} tok/s ({row['graphs_over_graphs_async']:.2f}x "
                     f"graphs){eager}")
    lines += [f"{part} FAILED: {report[part]['error']}" for part in ("parity", "speed")
              if "error" in report.get(part, {})]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny models, few tokens")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--parts", default="parity,speed")
    parser.add_argument("--itl-tokens", type=int, default=128)
    parser.add_argument("--streams", default="64,256")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--no-eager-throughput", action="store_true",
                        help="throughput with graphs and graphs + async only (less device time)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    args.streams = [int(n) for n in args.streams.split(",")]
    if args.small:
        args.itl_tokens, args.streams, args.prompt_len, args.output_len = 8, [4], 16, 8
    report: dict = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        report["device"] = torch.cuda.get_device_name(torch.device(args.device))
    for part, run in (("parity", lambda: parity(args.device, args.small)),
                      ("speed", lambda: speed(args))):
        if part not in args.parts.split(","):
            continue
        started = time.perf_counter()
        try:
            report[part] = run()
        except Exception as exc:  # noqa: BLE001  one part's failure still reports the other
            report[part] = {"error": repr(exc), "traceback": traceback.format_exc()}
        report[part]["seconds"] = time.perf_counter() - started
        if args.output:  # after each part: a later crash keeps the earlier results
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(report, indent=2) + "\n")
    print("\n".join(summary(report)))
    failed = any("error" in report.get(part, {}) for part in ("parity", "speed"))
    return 1 if failed or not report.get("parity", {}).get("ok", True) else 0


if __name__ == "__main__":
    sys.exit(main())
