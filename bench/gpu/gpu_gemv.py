"""The decode GEMV (kernels/gemv_triton.py) against cuBLAS at Llama-3.1-8B's
linear shapes, one to eight rows, bf16: each one's time and share of the
copy bandwidth, and what the tuner (DecodeGemv) picks.

    python -m bench.gpu.gpu_gemv --output OUT/gemv.json     (a CUDA machine: ~1 min)
    python -m bench.gpu.gpu_gemv --device cpu --small       (anywhere, TRITON_INTERPRET=1:
                                                           the script's smoke run, float32)

Bytes a call reads and writes: W (N x K) + x (M x K) + out (M x N). Times are
triton's do_bench medians with the L2 cache flushed before each call, as in
a decode step, where 15 GB of weights stream past a 50 MB cache. Every row
also checks the tuner's product against float64 (the bound of
tests/kernels/gemv_cases.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench.kernels.kernel_timing import copy_bandwidth_gbps, make_timer

# (name, N, K, per layer): Llama-3.1-8B's products; the LM head writes float32 logits.
SHAPES = (("qkv_proj", 6144, 4096, 32), ("o_proj", 4096, 4096, 32),
          ("gate_up_proj", 28672, 4096, 32), ("down_proj", 4096, 14336, 32),
          ("lm_head", 128256, 4096, 1))
SMALL_SHAPES = (("qkv_proj", 96, 64, 2), ("down_proj", 64, 160, 2), ("lm_head", 300, 64, 1))


def row(name: str, n: int, k: int, rows: int, device, dtype, timer, copy_gbps: float, tuner) -> dict:
    from kernels import gemv_triton as gt
    from tests.kernels.gemv_cases import check_close

    torch.manual_seed(rows)
    x = torch.randn(rows, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    float_out = name == "lm_head"
    moved = (n * k + rows * k) * w.element_size() + rows * n * (4 if float_out else w.element_size())
    cublas = timer(lambda: gt.linear_reference(x, w, None, float_out))
    configs = gt.ONE_ROW if rows == 1 else gt.FEW_ROWS
    triton_ms = {config: timer(lambda config=config: gt.gemv(x, w, None, float_out, config))
                 for config in configs}
    best = min(triton_ms, key=triton_ms.get)
    got = tuner.linear(x, w, None, float_out)
    error = check_close(got.cpu(), x.cpu(), w.cpu(), None)
    choice = tuner.choices[(gt.rows_bucket(rows), n, k, dtype, False, float_out)]
    gbps = lambda ms: moved / ms / 1e6  # noqa: E731
    return {"shape": name, "N": n, "K": k, "rows": rows, "bytes": moved,
            "cublas_ms": cublas, "cublas_pct_copy": 100 * gbps(cublas) / copy_gbps,
            "triton_ms": triton_ms[best], "triton_config": vars(best),
            "triton_pct_copy": 100 * gbps(triton_ms[best]) / copy_gbps,
            "cublas_over_triton": cublas / triton_ms[best],
            "tuner_choice": "cuBLAS" if choice is None else vars(choice), "ok": error is None,
            "error": error}


def model_total(rows: list[dict], shapes) -> dict:
    """One row's products of the whole model (every layer's shapes, the LM head once)."""
    per_layer = {name: count for name, _, _, count in shapes}
    ones = [r for r in rows if r["rows"] == 1]
    cublas = sum(r["cublas_ms"] * per_layer[r["shape"]] for r in ones)
    best = sum(min(r["cublas_ms"], r["triton_ms"]) * per_layer[r["shape"]] for r in ones)
    moved = sum(r["bytes"] * per_layer[r["shape"]] for r in ones)
    return {"rows": 1, "cublas_ms": cublas, "chosen_ms": best, "gb": moved / 1e9,
            "cublas_over_chosen": cublas / best}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    from kernels.gemv_triton import DecodeGemv

    device = torch.device(args.device)
    timer = make_timer(device, cpu_repeats=1)  # a CPU run is the interpreter's smoke run
    copy_gbps = copy_bandwidth_gbps(device, timer, 1 << 30 if not args.small else 1 << 20)
    shapes, dtype = (SMALL_SHAPES, torch.float32) if args.small else (SHAPES, torch.bfloat16)
    tuner = DecodeGemv() if device.type == "cuda" else _CpuTuner()
    rows = [row(name, n, k, m, device, dtype, timer, copy_gbps, tuner)
            for name, n, k, _ in shapes for m in (1, 2, 4, 8)]
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "copy_gbps": copy_gbps, "rows": rows, "model_one_row": model_total(rows, shapes)}
    for r in rows:
        print(f"{r['shape']:>12} {r['rows']}x{r['K']}->{r['N']}: cuBLAS {r['cublas_ms'] * 1e3:8.1f} us "
              f"({r['cublas_pct_copy']:5.1f} %)  triton {r['triton_ms'] * 1e3:8.1f} us "
              f"({r['triton_pct_copy']:5.1f} %)  x{r['cublas_over_triton']:.2f}  tuner: "
              f"{r['tuner_choice'] if isinstance(r['tuner_choice'], str) else 'triton'}  ok {r['ok']}")
    total = report["model_one_row"]
    print(f"model, one row: cuBLAS {total['cublas_ms']:.3f} ms, chosen {total['chosen_ms']:.3f} ms "
          f"({total['gb']:.2f} GB; copy {copy_gbps:.0f} GB/s)")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


class _CpuTuner:
    """The smoke run's stand-in for DecodeGemv (CUDA events do not exist on a CPU):
    the first candidate for every shape, through the same gemv entry point."""

    def __init__(self) -> None:
        self.choices: dict = {}

    def linear(self, x, w, bias, float_out):
        from kernels import gemv_triton as gt

        config = (gt.ONE_ROW if x.shape[0] == 1 else gt.FEW_ROWS)[0]
        self.choices[(gt.rows_bucket(x.shape[0]), w.shape[0], w.shape[1], w.dtype, False, float_out)] = config
        return gt.gemv(x, w, bias, float_out, config)


if __name__ == "__main__":
    sys.exit(main())
