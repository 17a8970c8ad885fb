"""Bandwidth and correctness of the Triton kernels that have only run under
the interpreter: the GGUF de-quantizing GEMM, multi-LoRA shrink / expand,
paged decode over int8 and fp8 KV caches.

    python -m bench.gpu.gpu_kernels --output OUT/new-kernels.json         (CUDA, real sizes)
    TRITON_INTERPRET=1 python -m bench.gpu.gpu_kernels --device cpu --small --output x.json

At Llama-3.1-8B's sizes (hidden 4096, intermediate 14336, 32 / 8 heads,
head_dim 128, block 16) each row times one kernel with do_bench and reports
ms, the bytes it must move (bench/gpu/gpu_kernel_cases.py says which), GB/s
and that as a share of the device's copy bandwidth: at decode sizes these
kernels are memory-bound, so the share says how far each is from its floor.
Beside the GGUF GEMM, F.linear over a bf16 weight of the same shape; beside
an int8 / fp8 cache, the bf16 cache's time (``vs_float_cache``). The GGUF
GEMM's ``ms`` is its bare launch; ``entry_ms`` is quant_linear's, as the
engine calls it, which also reads the blob's header back from the device
(a sync a call: at M = 1 it can cost more than the kernel).

Every row also checks its result against the reference (kernels/reference.py,
kernels/quant.py, kernels/lora.py) and records ``max_abs_err`` and ``ok``:
on a GPU that has never run these kernels compiled, a fast wrong answer is
the first thing to rule out. The exit status is 1 if any row is not ok or
failed, 3 if the time budget (``--budget-s``) left cases unrun.

Few cases and short timings (do_bench's warm-up 10 ms, 40 ms of calls):
about 50 rows and 25 Triton compilations, meant to finish in well under
90 s on an H100 / H200. ``--small`` is the smoke mode: tiny shapes in
float32 (the interpreter's bf16 arithmetic is wrong), every code path in
seconds; its times mean nothing.

Nothing here needs rich or tqdm (the GPU machine has torch and triton, not
our other packages); the GGUF rows need the ``gguf`` package, as the
kernels' own tests do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch


@dataclass(frozen=True)
class Sizes:
    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block: int = 16
    quant_types: tuple = ("Q4_0", "Q8_0", "Q4_K", "Q6_K")
    quant_rows: tuple = (1, 8)
    lora_ranks: tuple = (16, 64)
    lora_rows: tuple = (1, 8, 64)
    lora_adapters: int = 4
    decode: tuple = ((1, 4096), (32, 4096), (128, 4096))
    check_rows: int = 64   # quant_linear outputs checked against gguf's weights
    check_seqs: int = 2    # decode sequences checked against the reference


FULL = Sizes()
# K-quants need in_features in whole super-blocks of 256; head_dim 64 is the
# smallest the Triton attention takes.
SMALL = Sizes(hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, quant_rows=(1,),
              lora_ranks=(16,), lora_rows=(1, 5), decode=((1, 64), (3, 48)))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_cases(families: list[str], sizes: Sizes, device, dtype, timer, budget_s: float):
    """(rows, skipped): every case's row (an error row if it raised), and the
    labels of those left unrun once budget_s had passed."""
    from bench.gpu.gpu_kernel_cases import FAMILIES

    rows, skipped, start = [], [], time.perf_counter()
    for family in families:
        for label, thunk in FAMILIES[family](sizes, device, dtype, timer):
            if time.perf_counter() - start > budget_s:
                skipped.append(label)
                continue
            began = time.perf_counter()
            try:
                row = thunk()
            except Exception as exc:  # one broken kernel must not hide the others' results
                traceback.print_exc()
                row = {"kernel": label.split()[0], "case": label, "ok": False,
                       "error": f"{type(exc).__name__}: {exc}"[:2000]}
            row["label"], row["seconds"] = label, time.perf_counter() - began
            rows.append(row)
            print(f"{label}: {_status(row)} ({row['seconds']:.1f} s)", flush=True)
    return rows, skipped


def _status(row: dict) -> str:
    if "error" in row:
        return "ERROR " + row["error"].splitlines()[0][:200]
    return f"{'ok' if row['ok'] else 'WRONG'} max_abs_err {row['max_abs_err']:.3g}, {row['ms']:.4f} ms"


def _fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def print_rows(rows: list[dict]) -> None:
    """A plain table (no rich on the GPU machine)."""
    header = ["case", "rows", "ms", "MB", "GB/s", "% copy", "max err", "ok", "entry ms", "baseline ms",
              "base GB/s", "vs float"]
    table = [header]
    for r in rows:
        if "error" in r:
            table.append([r["label"]] + ["-"] * 6 + ["ERROR"] + ["-"] * 4)
            continue
        table.append([f"{r['kernel']} {r['case']}", str(r.get("rows", "-")), f"{r['ms']:.4f}",
                      f"{r['bytes'] / 1e6:.1f}", f"{r['gbps']:.0f}", _fmt(r.get("fraction_of_copy"), "{:.0%}"),
                      f"{r['max_abs_err']:.2g}", "ok" if r["ok"] else "WRONG",
                      _fmt(r.get("entry_ms"), "{:.4f}"),
                      _fmt(r.get("baseline_ms"), "{:.4f}"), _fmt(r.get("baseline_gbps"), "{:.0f}"),
                      _fmt(r.get("vs_float_cache"), "{:.2f}x")])
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for line in table:
        cells = [line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:], widths[1:])]
        print("  ".join(cells))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu.gpu_kernels",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument("--small", action="store_true", help="tiny shapes: the smoke mode")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--parts", default="quant,lora,decode", help="comma list of quant,lora,decode")
    parser.add_argument("--quant-types", default=None, help="comma list (default: Q4_0,Q8_0,Q4_K,Q6_K)")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="start no case after this many seconds (a JSON is still written)")
    parser.add_argument("--copy-bytes", type=int, default=1 << 30,
                        help="tensor size for the copy-bandwidth measurement")
    return parser


def _setup(args) -> tuple[torch.device, torch.dtype]:
    """The device and dtype; on the CPU, the interpreter switched on before
    triton is first imported (it cannot be afterwards)."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise SystemExit("on the CPU set TRITON_INTERPRET=1 before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    return device, dtype


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device, dtype = _setup(args)
    from bench.kernels.kernel_timing import copy_bandwidth_gbps, make_timer

    sizes = SMALL if args.small else FULL
    if args.quant_types:
        sizes = replace(sizes, quant_types=tuple(args.quant_types.split(",")))
    torch.manual_seed(0)
    timer = make_timer(device, warmup_ms=10, rep_ms=40, cpu_repeats=1)
    copy_bytes = args.copy_bytes if device.type == "cuda" else min(args.copy_bytes, 1 << 24)
    copy_gbps = copy_bandwidth_gbps(device, timer, copy_bytes)
    families = [p for p in args.parts.split(",") if p]
    start = time.perf_counter()
    rows, skipped = run_cases(families, sizes, device, dtype, timer, args.budget_s)
    for row in rows:
        if "gbps" in row:
            row["fraction_of_copy"] = row["gbps"] / copy_gbps
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"\n{name}, {str(dtype).replace('torch.', '')}; copy bandwidth {copy_gbps:.1f} GB/s; "
          f"{len(rows)} rows in {time.perf_counter() - start:.1f} s")
    print_rows(rows)
    for label in skipped:
        print(f"skipped (past --budget-s {args.budget_s:g}): {label}")
    ok = all(row["ok"] for row in rows)
    report = {"device": name, "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
              "triton": _triton_version(), "sizes": asdict(sizes), "copy_bandwidth_gbps": copy_gbps,
              "seconds": time.perf_counter() - start, "ok": ok and not skipped,
              "rows": rows, "skipped": skipped}
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.output}")
    return 1 if not ok else 3 if skipped else 0


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    raise SystemExit(main())
