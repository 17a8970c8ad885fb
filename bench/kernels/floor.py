"""The weight-read floor of one-stream decode (``pagedserve bench kernels --floor``).

    pagedserve bench kernels --floor [--floor-model NAME] [--output floor.json]

A decode step of one sequence must read every weight of the model once, so
no step can be faster than the weights' bytes over the memory's read
bandwidth. This measures both on the machine it runs on, and the engine
against them:

* read bandwidth: a read-only reduction (``torch.sum``, float32) over a
  buffer much larger than the caches (``--floor-read-bytes``, 1 GiB; on the
  CPU on huge pages where offered, like the engine's weights), with
  the threads the engine steps with, ``--floor-read-runs`` times a round;
  the best run is the machine's bandwidth (the floor is a bound, so it
  takes the fastest the memory was seen to go), the median is reported
  too. One float32 add per 4 bytes is far below what a core does on AVX2 or
  AVX-512 (in L2 the same sum runs at ~75 GB/s a core on either), so it
  runs at the memory's speed on both ISAs;
* weight bytes: the model loaded through ``engine.frontend.llm.LLM`` as
  the engine holds it (default model, default dtype, packed where the
  backend packs): ``engine.memory_per_rank()[0]["weights_bytes"]`` (its
  parameters and buffers; a tied LM head is counted once, as it is held);
* floor ms/token = weight bytes / read bandwidth;
* measured ms/token: the same short prompt generated greedily with
  ignore_eos to 1 token and to 1 + N tokens after a warm-up;
  (best long - best short) / N, so the prefill and the request's fixed
  costs drop out and every decode step's engine work (scheduling, sampling,
  detokenizing) stays in;
* the two alternate: ``--floor-repeats`` rounds of reads, a short run and
  a long run. On the shared 2-core VM the memory's read bandwidth moved
  between ~45 and ~75 GB/s from minute to minute (2026-11-27), so a floor
  read apart from the decode it bounds would say little; each round's own
  ratio is kept too;
* ratio = measured / floor (the target: at most 1.5 for float weights,
  issue #40's; at most 1.3 for a GGUF file served quantized, #53's);
* the chunked read: the same bytes read the way a step splits them, one
  reduction per weight tensor of at least 64 KiB in the model's order (a
  linear's parallel region reads one tensor) and one for the small rest,
  back to back, best of ``--floor-read-runs`` a round. A short region pays
  a fork, a join and a cold start of the memory stream (on the 2-core Xeon,
  2026-11-30: 64 KiB regions read at 8 GB/s, 1.1 MB at 17, one 66 MB read
  at 20), so this is the floor of a step that keeps one region per linear;
  chunked_ratio = measured / it separates the kernels' own cost from the
  price of the step's shape.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.common.report import write_json

FLOOR_PROMPT = "The history of the printing press begins"
TARGET_RATIO = 1.5  # float weights (#40)
GGUF_TARGET_RATIO = 1.3  # a GGUF file's own quantized weights (#53)
CHUNK_MIN_BYTES = 1 << 16  # smaller tensors (norms, biases) are read inside a bigger op


def add_floor_args(parser) -> None:
    from engine.config import DEFAULT_MODEL

    group = parser.add_argument_group("weight-read floor of one-stream decode (--floor)")
    group.add_argument("--floor", action="store_true",
                       help="measure the floor and the engine's one-stream decode instead of kernels")
    group.add_argument("--floor-model", default=DEFAULT_MODEL, help="model to load (default: %(default)s)")
    group.add_argument("--floor-dtype", default="auto", help="engine --dtype (default: auto)")
    group.add_argument("--floor-read-bytes", type=int, default=1 << 30,
                       help="buffer read for the bandwidth (default: 1 GiB)")
    group.add_argument("--floor-read-runs", type=int, default=3, help="reads per round")
    group.add_argument("--floor-tokens", type=int, default=128,
                       help="N: decode steps between the short and the long run")
    group.add_argument("--floor-repeats", type=int, default=5,
                       help="rounds of reads, a short run and a long run; the best of each counts")
    group.add_argument("--floor-kv-cache-bytes", type=int, default=None,
                       help="engine --kv-cache-memory-bytes (default: the engine's)")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of float32 ones, every page touched; on the CPU on huge
    pages where Linux offers them, as the engine holds its weights (they
    read faster: a float32 sum over 1 GiB 25.7 -> 27.3 GB/s on the 2-core
    AVX2 EPYC), so the floor is the best the memory gives."""
    count = nbytes // 4
    if device.type != "cpu":
        return torch.ones(count, dtype=torch.float32, device=device)
    from engine.model.cpu_allocator import huge_page_bytes

    buffer = huge_page_bytes(count * 4)  # advised before fill_() touches the pages
    if buffer is None:
        return torch.ones(count, dtype=torch.float32)
    return buffer.view(torch.float32).fill_(1.0)


def time_reads(buffer: torch.Tensor, runs: int) -> list[float]:
    """Seconds of each of ``runs`` read-only reductions over ``buffer``."""
    seconds = []
    for _ in range(runs):
        _sync(buffer.device)
        started = time.perf_counter()
        total = buffer.sum()
        _sync(buffer.device)
        seconds.append(time.perf_counter() - started)
        assert abs(float(total) - buffer.numel()) <= 1e-3 * buffer.numel()  # read it all
    return seconds


def read_summary(nbytes: int, seconds: list[float]) -> dict:
    return {"bytes": nbytes, "runs": len(seconds), "threads": torch.get_num_threads(),
            "seconds": seconds, "gbps_best": nbytes / min(seconds) / 1e9,
            "gbps_median": nbytes / statistics.median(seconds) / 1e9}


def read_bandwidth(nbytes: int, runs: int, device: torch.device) -> dict:
    """GB/s of a read-only reduction over ``nbytes`` of float32, best and median."""
    buffer = read_buffer(nbytes, device)
    time_reads(buffer, 1)  # warm-up
    return read_summary(buffer.numel() * 4, time_reads(buffer, runs))


def step_chunks(model: torch.nn.Module) -> list[int]:
    """Bytes of the reads a decode step makes, as it splits them: each
    parameter or buffer of at least CHUNK_MIN_BYTES on its own, in the
    model's order, and the small ones as one more. The same tensors as the
    runner's ``weights_bytes`` (a tied head counted once)."""
    sizes = [t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())]
    chunks = [size for size in sizes if size >= CHUNK_MIN_BYTES]
    rest = sum(sizes) - sum(chunks)
    return chunks + ([rest] if rest else [])


def chunk_views(buffer: torch.Tensor, chunks: list[int]) -> list[torch.Tensor]:
    """Consecutive float32 views of ``buffer``, one per chunk (its bytes
    rounded down to whole floats, at least one)."""
    views, start = [], 0
    for nbytes in chunks:
        count = max(1, nbytes // 4)
        views.append(buffer[start:start + count])
        start += count
    return views


def time_chunked_reads(views: list[torch.Tensor], runs: int) -> list[float]:
    """Seconds of each of ``runs`` passes of one reduction per view, in turn."""
    seconds = []
    for _ in range(runs):
        _sync(views[0].device)
        started = time.perf_counter()
        for view in views:
            view.sum()
        _sync(views[0].device)
        seconds.append(time.perf_counter() - started)
    return seconds


def chunked_summary(views: list[torch.Tensor], seconds: list[float]) -> dict:
    nbytes = sum(view.numel() * 4 for view in views)
    return {"chunks": len(views), "bytes": nbytes, "runs": len(seconds), "seconds": seconds,
            "ms_best": min(seconds) * 1e3, "gbps_best": nbytes / min(seconds) / 1e9}


def decode_runner(llm, prompt: str):
    """run(count): seconds to generate ``count`` tokens of ``prompt``, greedy, ignore_eos."""
    from engine.sampling_params import SamplingParams

    device = llm.engine.runner.device

    def run(count: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=count, ignore_eos=True)
        _sync(device)
        started = time.perf_counter()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        _sync(device)
        assert len(out.outputs[0].token_ids) == count
        return time.perf_counter() - started

    return run


def decode_summary(tokens: int, short: list[float], long: list[float]) -> dict:
    """(best time to 1 + tokens tokens - best time to 1 token) / tokens, in ms."""
    return {"tokens": tokens, "repeats": len(short), "short_seconds": short, "long_seconds": long,
            "ms_per_token": (min(long) - min(short)) / tokens * 1e3,
            "ms_per_token_median": (statistics.median(long) - statistics.median(short)) / tokens * 1e3}


def measure(llm, args) -> tuple[dict, dict, dict, list[dict]]:
    """Reads, chunked reads and decodes alternated round by round (a shared
    machine's memory bandwidth moves within seconds): (read, chunked read,
    decode, per-round figures)."""
    run = decode_runner(llm, FLOOR_PROMPT)
    device, runs = llm.engine.runner.device, args.floor_read_runs
    buffer = read_buffer(args.floor_read_bytes, device)
    chunks = step_chunks(llm.engine.runner.model)
    views = chunk_views(read_buffer(sum(chunks) + 4 * len(chunks), device), chunks)
    nbytes, tokens = buffer.numel() * 4, args.floor_tokens
    run(1 + tokens)  # warm-up: compiled ops loaded, caches and threads started
    time_reads(buffer, 1)
    time_chunked_reads(views, 1)
    reads, chunked, short, long, rounds = [], [], [], [], []
    for _ in range(args.floor_repeats):
        reads += time_reads(buffer, runs)
        chunked += time_chunked_reads(views, runs)
        short.append(run(1))
        long.append(run(1 + tokens))
        rounds.append({"read_gbps": nbytes / min(reads[-runs:]) / 1e9,
                       "chunked_ms": min(chunked[-runs:]) * 1e3,
                       "ms_per_token": (long[-1] - short[-1]) / tokens * 1e3})
    return (read_summary(nbytes, reads), chunked_summary(views, chunked),
            decode_summary(tokens, short, long), rounds)


def floor_numbers(read: dict, weights_bytes: int, decode: dict, gguf: bool = False) -> dict:
    """The floor and the measured decode against it (`gguf`: the weights
    served in their file's quant types, held to the stricter target)."""
    floor_ms = weights_bytes / (read["gbps_best"] * 1e9) * 1e3
    measured = decode["ms_per_token"]
    target = GGUF_TARGET_RATIO if gguf else TARGET_RATIO
    return {"weights_bytes": weights_bytes, "weights_mb": weights_bytes / 1e6,
            "read_gbps": read["gbps_best"], "floor_ms_per_token": floor_ms,
            "measured_ms_per_token": measured, "ratio": measured / floor_ms,
            "target_ratio": target, "meets_target": measured / floor_ms <= target}


def machine_isa() -> dict:
    """The ISA a figure belongs to: the CPU's flags, and the builds that ran."""
    from kernels.cpu import ops as cpu_ops

    flags = cpu_ops.cpuinfo_flags()
    cpu = ("avx512_bf16" if "avx512_bf16" in flags else "avx512_vnni" if "avx512_vnni" in flags
           else "avx2" if "avx2" in flags else "other")
    return {"cpu": cpu, "engine_cpu_kernels": cpu_ops.requested_isa(),
            "aten_capability": torch.backends.cpu.get_cpu_capability()}


def load_engine(args):
    from engine.frontend.llm import LLM

    engine_args = {"dtype": args.floor_dtype}
    if args.floor_kv_cache_bytes is not None:
        engine_args["kv_cache_memory_bytes"] = args.floor_kv_cache_bytes
    return LLM(args.floor_model, **engine_args)


def run_floor(args) -> int:
    """--floor: load the model, measure, print the report and write its JSON."""
    llm = load_engine(args)
    weights_bytes = llm.engine.memory_per_rank()[0]["weights_bytes"]
    device = llm.engine.runner.device
    read, chunked, decode, rounds = measure(llm, args)
    numbers = floor_numbers(read, weights_bytes, decode, llm.engine.config.quantization == "gguf")
    numbers["chunked_ratio"] = decode["ms_per_token"] / chunked["ms_best"]
    for one in rounds:  # each round's decode against its own reads
        one["ratio"] = one["ms_per_token"] / (weights_bytes / one["read_gbps"] / 1e6)
    dtype = str(llm.engine.runner.dtype).replace("torch.", "")
    report = {"model": args.floor_model, "dtype": dtype, "device": str(device),
              "isa": machine_isa(), "torch_threads": torch.get_num_threads(),
              "loadavg": _loadavg(), "read": read, "chunked_read": chunked, "decode": decode,
              "rounds": rounds, **numbers}
    print_floor(report)
    if args.output:
        write_json(args.output, report)
    return 0


def print_floor(report: dict) -> None:
    isa, read, decode = report["isa"], report["read"], report["decode"]
    verdict = "meets" if report["meets_target"] else "misses"
    print(f"\n{report['model']} ({report['dtype']}) on {report['device']}; CPU {isa['cpu']}, "
          f"engine kernels {isa['engine_cpu_kernels']}, ATen {isa['aten_capability']}, "
          f"{report['torch_threads']} threads; load {report['loadavg']}")
    print(f"read bandwidth   {report['read_gbps']:8.1f} GB/s  (best of {read['runs']}; "
          f"median {read['gbps_median']:.1f}; {read['bytes'] / 2**20:.0f} MiB, {read['threads']} threads)")
    print(f"weights          {report['weights_mb']:8.1f} MB")
    print(f"floor            {report['floor_ms_per_token']:8.2f} ms/token")
    print(f"measured         {report['measured_ms_per_token']:8.2f} ms/token  (1 vs 1+{decode['tokens']} "
          f"tokens, best of {decode['repeats']}; medians give {decode['ms_per_token_median']:.2f})")
    print(f"ratio            {report['ratio']:8.2f}x  ({verdict} the {report['target_ratio']}x target)")
    chunked = report["chunked_read"]
    print(f"chunked read     {chunked['ms_best']:8.2f} ms/token  ({chunked['chunks']} reductions, "
          f"{chunked['gbps_best']:.1f} GB/s; measured / it {report['chunked_ratio']:.2f}x)")
    print("rounds           " + "; ".join(f"{r['read_gbps']:.1f} GB/s {r['ms_per_token']:.2f} ms "
                                          f"{r['ratio']:.2f}x (chunked {r['chunked_ms']:.2f} ms)"
                                          for r in report["rounds"]))


def _loadavg() -> str | None:
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return None
