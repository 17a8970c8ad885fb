"""Offline throughput: this engine vs HF `generate`, same workloads, same process.

    pagedserve bench throughput [--workload chat|prefill-heavy|both] [--dtype bfloat16]
        [--chat-num-prompts 256] [--prefill-num-prompts 64] [--hf-batch-sizes 16,64]
        [--hf-sort both] [--output results.json]

Workloads (random-token prompts, fixed seeds, greedy, ignore_eos so every
request produces exactly the tokens it asked for):

    chat            256 requests, prompts 16-256 tokens, outputs 16-512 tokens
    prefill-heavy    64 requests, prompts 64-1024 tokens, outputs 64 tokens

Per workload, in this order and in this process, on the same dtype and threads:

  * pagedserve: a fresh engine; the bench drives `engine.step()` itself, so it
    can sample the KV cache between steps (that sampling is not timed).
  * HF `generate` in each configuration of --hf-batch-sizes x --hf-sort
    (requests length-sorted by (output, prompt) length or in arrival order),
    a fresh model each, left padding, each batch generating until its longest
    request is done (only the requested tokens count). The fastest is "best HF".

Reported per system: seconds, output/total tokens per second, requests per
second, peak memory above the level before the system was loaded (CPU: process
RSS sampled every 20 ms, after gc + malloc_trim; CUDA: max_memory_allocated) —
pagedserve's includes its whole KV cache reservation (--kv-cache-memory-bytes),
HF's the KV cache its batches grow — and the fraction of the compute floor it
reaches (floor_seconds / seconds).

Compute floor: the workload's FLOPs (bench/measure.py)

    per request, L = prompt + output - 1 tokens fed:
      2 * layer_linear_params * L  +  2 * hidden * vocab * output
      + 4 * layers * heads * head_dim * L (L + 1) / 2      (QK^T and PV, causal)

divided by the best F.linear rate measured at the start of this run on the
model's own linear shapes, same dtype and device.

KV utilisation (pagedserve run, sampled after every step, weighted by the
step's duration): tokens whose K/V are held by running sequences over the
slots of the blocks in their block tables, against what a contiguous
max_model_len reservation per running sequence would give for the same batch.
From the mean tokens per running sequence follows how many sequences each
scheme fits in this engine's KV memory.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from bench.measure import (FLOP_FORMULA, PeakMemory, machine_info, matmul_rate, release_memory,
                           workload_flops)
from engine.cli import add_engine_args, config_from_args

WORKLOADS = {
    # name: (num_prompts, prompt LOW:HIGH, output LOW:HIGH, seed)
    "chat": (256, (16, 256), (16, 512), 0),
    "prefill-heavy": (64, (64, 1024), (64, 64), 1),
}


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    input_range: tuple[int, int]
    output_range: tuple[int, int]
    seed: int

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def settings(self) -> dict:
        return {
            "name": self.name,
            "num_prompts": len(self.prompts),
            "input_len": list(self.input_range),
            "output_len": list(self.output_range),
            "seed": self.seed,
            "ignore_eos": True,
            "greedy": True,
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "max_prompt_plus_output": max(len(p) + o for p, o in zip(self.prompts,
                                                                     self.output_lens)),
        }


@dataclass
class Result:
    system: str
    config: str
    seconds: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    requests_per_s: float
    peak_memory_bytes: int
    fraction_of_floor: float = 0.0
    extra: dict = field(default_factory=dict)


def make_workload(name, num_prompts, input_range, output_range, vocab_size, seed) -> Workload:
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num_prompts):
        length = rng.randint(*input_range)
        # Skip the first ids: they are the special tokens of most vocabularies.
        prompts.append([rng.randrange(100, vocab_size) for _ in range(length)])
        outputs.append(rng.randint(*output_range))
    return Workload(name, prompts, outputs, tuple(input_range), tuple(output_range), seed)


# -- pagedserve ---------------------------------------------------------------------------
def run_engine(config, workload: Workload, device) -> Result:
    from engine import LLM, SamplingParams

    with PeakMemory(device) as mem:
        llm = LLM.from_config(config)
        engine = llm.engine
        warm = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * 2
        llm.generate([{"prompt_token_ids": p} for p in workload.prompts[:2]], warm,
                     use_tqdm=False)
        llm.reset_prefix_cache()  # the warm-up prompts must not be prefix hits
        before = engine.stats()
        seconds, kv, steps = _drive(engine, workload)
        after = engine.stats()
    num_blocks = engine.block_manager.num_usable_blocks
    block_size = engine.config.block_size
    kv_bytes = engine.runner.num_blocks * engine.runner.bytes_per_block()
    config = engine.config
    del llm, engine
    release_memory()
    kv.update(_kv_capacity(kv, num_blocks, block_size, config.max_model_len))
    settings = (f"block_size={config.block_size}, max_num_seqs={config.max_num_seqs}, "
                f"max_num_batched_tokens={config.max_num_batched_tokens}, "
                f"kernels={config.kernel_backend}")
    extra = {
        "steps": steps,
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        "prefix_cache_hits": after["prefix_cache_hits"] - before["prefix_cache_hits"],
        "kv_cache_bytes": kv_bytes,
        "kv_blocks": num_blocks,
        "block_size": block_size,
        "max_model_len": config.max_model_len,
        "memory": mem.as_dict(),
        "kv_utilization": kv,
    }
    return _result("pagedserve", settings, seconds, workload, mem.peak_bytes, extra)


def _drive(engine, workload: Workload) -> tuple[float, dict, int]:
    """Run the workload step by step; return engine seconds and KV samples."""
    from engine import SamplingParams

    block_size = engine.config.block_size
    max_len = engine.config.max_model_len
    tables = engine.block_manager.block_tables
    ids = [f"{workload.name}-{i}" for i in range(len(workload.prompts))]
    produced = {}
    weights, paged, contiguous, held_sum, slots_sum, seqs_sum = [], [], [], [], [], []
    steps = 0
    in_engine = 0.0
    with tqdm(total=len(ids), desc=f"pagedserve {workload.name}", unit="req") as bar:
        start = time.perf_counter()
        for request_id, prompt, n in zip(ids, workload.prompts, workload.output_lens):
            engine.add_request(request_id, list(prompt),
                               SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        in_engine += time.perf_counter() - start
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outputs = engine.step()
            step_s = time.perf_counter() - t0
            in_engine += step_s
            steps += 1
            # Not timed: what the running sequences hold right after the step.
            held = slots = running = 0
            for seq in engine.scheduler.running:
                table = tables.get(seq.seq_id)
                if not table:
                    continue
                seq_slots = len(table) * block_size
                held += min(seq.num_computed_tokens, seq_slots)
                slots += seq_slots
                running += 1
            if held:
                weights.append(step_s)
                paged.append(held / slots)
                contiguous.append(held / (running * max_len))
                held_sum.append(held)
                slots_sum.append(slots)
                seqs_sum.append(running)
            for output in outputs:
                if output.finished:
                    produced[output.request_id] = len(output.outputs[0].token_ids)
                    bar.update(1)
    assert sum(produced.values()) == workload.num_output_tokens, (
        sum(produced.values()), workload.num_output_tokens)
    total_w = sum(weights) or 1.0

    def avg(values):
        return sum(w * v for w, v in zip(weights, values)) / total_w

    kv = {
        "definition": "time-weighted mean over steps of tokens whose K/V are held by running "
                      "sequences / slots: paged = blocks in their tables x block_size, "
                      "contiguous = running sequences x max_model_len",
        "paged": avg(paged) if weights else 0.0,
        "contiguous": avg(contiguous) if weights else 0.0,
        "mean_running_seqs": avg(seqs_sum) if weights else 0.0,
        "max_running_seqs": max(seqs_sum, default=0),
        "mean_tokens_held": avg(held_sum) if weights else 0.0,
        "max_tokens_held": max(held_sum, default=0),
        "mean_slots_allocated": avg(slots_sum) if weights else 0.0,
        "samples": len(weights),
    }
    return in_engine, kv, steps


def _kv_capacity(kv: dict, num_blocks: int, block_size: int, max_model_len: int) -> dict:
    slots = num_blocks * block_size
    per_seq = kv["mean_tokens_held"] / kv["mean_running_seqs"] if kv["mean_running_seqs"] else 0
    slots_per_seq = (kv["mean_slots_allocated"] / kv["mean_running_seqs"]
                     if kv["mean_running_seqs"] else 0)
    return {
        "kv_slots": slots,
        "mean_tokens_per_seq": per_seq,
        "mean_slots_per_seq": slots_per_seq,
        # the issue's figure: KV memory / mean tokens per sequence
        "paged_seqs_fit": int(slots / per_seq) if per_seq else 0,
        # the same with each sequence's last, partly filled block counted in full
        "paged_seqs_fit_whole_blocks": int(slots / slots_per_seq) if slots_per_seq else 0,
        "contiguous_seqs_fit": slots // max_model_len,
    }


# -- HF generate ----------------------------------------------------------------------------
def run_hf(model_path: Path, dtype, device, workload: Workload, batch_size: int,
           sort: bool) -> Result:
    from transformers import AutoModelForCausalLM

    n = len(workload.prompts)
    if sort:  # fewest wasted decode steps, then least prompt padding
        order = sorted(range(n), key=lambda i: (workload.output_lens[i], len(workload.prompts[i])))
    else:
        order = list(range(n))
    batches = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    config = f"batch_size={batch_size}, {'length-sorted' if sort else 'arrival order'}"
    with PeakMemory(device) as mem:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
        model = model.to(device).eval()
        model.generation_config.eos_token_id = None  # ignore_eos: every row runs to the end
        _hf_batch(model, workload, batches[0][:2], device, max_new_tokens=4)  # warm-up
        start = time.perf_counter()
        padded = 0
        for batch in tqdm(batches, desc=f"HF {workload.name} ({config})", unit="batch"):
            padded += _hf_batch(model, workload, batch, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    del model
    release_memory()
    extra = {"batch_size": batch_size, "sorted": sort, "num_batches": len(batches),
             "token_slots_computed": padded, "memory": mem.as_dict()}
    return _result("HF generate", config, seconds, workload, mem.peak_bytes, extra)


def _hf_batch(model, workload: Workload, batch: list[int], device,
              max_new_tokens: int | None = None) -> int:
    """Generate one left-padded batch; return the token positions it computed."""
    prompts = [workload.prompts[i] for i in batch]
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding, as decoder-only generation needs
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    new = max_new_tokens or max(workload.output_lens[i] for i in batch)
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids.to(device), attention_mask=mask.to(device), do_sample=False,
            pad_token_id=0, max_new_tokens=new,
        )
    return len(batch) * (width + new - 1)


def _result(system, config, seconds, workload: Workload, peak, extra) -> Result:
    out = workload.num_output_tokens
    total = out + workload.num_prompt_tokens
    return Result(system, config, seconds, out / seconds, total / seconds,
                  len(workload.prompts) / seconds, peak, extra=extra)


# -- report --------------------------------------------------------------------------------
def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def print_workload(report: dict) -> None:
    s = report["settings"]
    fl = report["flops"]
    print(f"\n== {s['name']}: {s['num_prompts']} requests, prompts {s['input_len'][0]}-"
          f"{s['input_len'][1]}, outputs {s['output_len'][0]}-{s['output_len'][1]} "
          f"({s['prompt_tokens']:,} prompt + {s['output_tokens']:,} output tokens)")
    print(f"   {fl['total'] / 1e12:.2f} TFLOP (linear {fl['linear'] / 1e12:.2f}, "
          f"lm_head {fl['lm_head'] / 1e12:.2f}, attention {fl['attention'] / 1e12:.2f}); "
          f"floor {report['floor_seconds']:.1f} s at {report['matmul_gflops']:.1f} GFLOP/s")
    header = (f"  {'system':<12}{'config':<34}{'seconds':>9}{'out tok/s':>11}{'total tok/s':>13}"
              f"{'req/s':>8}{'peak MiB':>10}{'of floor':>10}")
    print(header)
    print("  " + "-" * (len(header) - 2))
    best = report["hf_best_index"]
    rows = [(" ", report["pagedserve"])] + [
        ("*" if i == best else " ", r) for i, r in enumerate(report["hf"])]
    for mark, r in rows:
        config = r["config"] if r["system"] == "HF generate" else "block_size=%d" % (
            r["extra"]["block_size"])
        print(f"{mark} {r['system']:<12}{config:<34}{r['seconds']:>9.1f}"
              f"{r['output_tokens_per_s']:>11.1f}{r['total_tokens_per_s']:>13.1f}"
              f"{r['requests_per_s']:>8.2f}{_mib(r['peak_memory_bytes']):>10}"
              f"{r['fraction_of_floor']:>10.1%}")
    if report["hf_best"]:
        print(f"  * best HF. pagedserve / best HF: throughput {report['ratio_vs_best_hf']:.2f}x, "
              f"peak memory {report['memory_ratio_vs_best_hf']:.2f}x (pagedserve's includes "
              f"its {_mib(report['pagedserve']['extra']['kv_cache_bytes'])} MiB KV cache)")
    kv = report["pagedserve"]["extra"]["kv_utilization"]
    max_len = report["pagedserve"]["extra"]["max_model_len"]
    print(f"  KV utilisation (time-averaged): paged {kv['paged']:.1%}, contiguous "
          f"max_model_len={max_len} reservation {kv['contiguous']:.2%}; "
          f"mean {kv['mean_running_seqs']:.1f} running seqs, {kv['mean_tokens_per_seq']:.0f} "
          f"tokens each")
    print(f"  sequences that fit in the {kv['kv_slots']:,}-slot KV cache: paged "
          f"{kv['paged_seqs_fit']} ({kv['paged_seqs_fit_whole_blocks']} counting whole blocks), "
          f"contiguous {kv['contiguous_seqs_fit']}")


def parse_range(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(":"))
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"bad range {text!r}: want LOW:HIGH, 0 < LOW <= HIGH")
    return low, high


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve bench throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("chat", "prefill-heavy", "both"), default="both")
    parser.add_argument("--num-prompts", type=int,
                        help="requests in every workload run (overrides the two below)")
    parser.add_argument("--chat-num-prompts", type=int, default=WORKLOADS["chat"][0])
    parser.add_argument("--prefill-num-prompts", type=int, default=WORKLOADS["prefill-heavy"][0])
    parser.add_argument("--chat-input-len", type=parse_range, default=WORKLOADS["chat"][1],
                        help="LOW:HIGH prompt tokens (default %(default)s)")
    parser.add_argument("--chat-output-len", type=parse_range, default=WORKLOADS["chat"][2])
    parser.add_argument("--prefill-input-len", type=parse_range,
                        default=WORKLOADS["prefill-heavy"][1])
    parser.add_argument("--prefill-output-len", type=parse_range,
                        default=WORKLOADS["prefill-heavy"][2])
    parser.add_argument("--workload-seed", type=int, default=0,
                        help="added to each workload's fixed seed")
    parser.add_argument("--hf-batch-sizes", type=parse_ints, default=[16, 64],
                        help="comma-separated HF batch sizes to try (default 16,64)")
    parser.add_argument("--hf-sort", choices=("both", "sorted", "unsorted"), default="both",
                        help="HF batches length-sorted, in arrival order, or both (default)")
    parser.add_argument("--matmul-tokens", type=parse_ints, default=[64, 256, 1024],
                        help="rows of the matmul-rate measurement (best counts)")
    parser.add_argument("--skip-hf", action="store_true", help="pagedserve only")
    parser.add_argument("--output", type=Path, help="write everything as JSON here")
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)

    from engine.model_runner import resolve_device, resolve_dtype
    from engine.models.loader import load_hf_config, resolve_model_path

    model_path = resolve_model_path(config.model, config.cache_dir)
    hf_config = load_hf_config(model_path)
    config = config.resolve_max_model_len(hf_config.max_position_embeddings)
    device = resolve_device(config)
    dtype = resolve_dtype(config, hf_config, device)

    names = ["chat", "prefill-heavy"] if args.workload == "both" else [args.workload]
    workloads = []
    for name in names:
        count, _, _, seed = WORKLOADS[name]
        if name == "chat":
            count, inputs, outputs = args.chat_num_prompts, args.chat_input_len, args.chat_output_len
        else:
            count, inputs, outputs = (args.prefill_num_prompts, args.prefill_input_len,
                                      args.prefill_output_len)
        count = args.num_prompts or count
        if inputs[1] + outputs[1] > config.max_model_len:
            raise ValueError(f"{name}: prompts up to {inputs[1]} + outputs up to {outputs[1]} "
                             f"tokens exceed max_model_len={config.max_model_len}")
        workloads.append(make_workload(name, count, inputs, outputs, hf_config.vocab_size,
                                       seed + args.workload_seed))
    sorts = {"both": [True, False], "sorted": [True], "unsorted": [False]}[args.hf_sort]

    print(f"matmul rate ({dtype}, {device}) ...", flush=True)
    rate = matmul_rate(hf_config, dtype, device, token_counts=args.matmul_tokens)
    gflops = rate["best_gflops"]
    print(f"  {gflops:.1f} GFLOP/s (best of rows {args.matmul_tokens}: "
          + ", ".join(f"{k}: {v:.1f}" for k, v in rate["gflops_per_token_count"].items()) + ")")

    print(f"model {model_path.name}, dtype {dtype}, device {device}, "
          f"{torch.get_num_threads()} threads, max_model_len {config.max_model_len}")
    reports = {}
    for workload in workloads:
        flops = workload_flops(hf_config, [len(p) for p in workload.prompts],
                               workload.output_lens)
        floor = flops["total"] / (gflops * 1e9)
        ours = run_engine(config, workload, device)
        hf_runs = [] if args.skip_hf else [
            run_hf(model_path, dtype, device, workload, b, s)
            for b in args.hf_batch_sizes for s in sorts]
        for r in [ours, *hf_runs]:
            r.fraction_of_floor = floor / r.seconds
        best = max(range(len(hf_runs)), key=lambda i: hf_runs[i].output_tokens_per_s,
                   default=None)
        best_hf = hf_runs[best] if best is not None else None
        report = {
            "settings": workload.settings(),
            "flops": flops,
            "matmul_gflops": gflops,
            "floor_seconds": floor,
            "pagedserve": asdict(ours),
            "hf": [asdict(r) for r in hf_runs],
            "hf_best_index": best,
            "hf_best": asdict(best_hf) if best_hf else None,
            "ratio_vs_best_hf": (ours.output_tokens_per_s / best_hf.output_tokens_per_s
                                 if best_hf else None),
            "memory_ratio_vs_best_hf": (ours.peak_memory_bytes / max(1, best_hf.peak_memory_bytes)
                                        if best_hf else None),
        }
        reports[workload.name] = report
        print_workload(report)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        full = {
            "benchmark": "throughput",
            "model": model_path.name,
            "dtype": str(dtype),
            "device": str(device),
            "engine_config": {k: v for k, v in vars(config).items() if _jsonable(v)},
            "hf": {"batch_sizes": args.hf_batch_sizes,
                   "sorted": sorts, "skipped": args.skip_hf},
            "machine": machine_info(device),
            "matmul": rate,
            "flop_formula": FLOP_FORMULA,
            "workloads": reports,
        }
        args.output.write_text(json.dumps(full, indent=2))
        print(f"wrote {args.output}")
    return 0


def _jsonable(value) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


if __name__ == "__main__":
    raise SystemExit(main())
