"""Timing for the kernel benchmark (bench/kernels/kernels.py): the same clock for the
kernel under test and its baseline, and the copy bandwidth both are read
against."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def make_timer(device: torch.device, *, warmup_ms: int = 25, rep_ms: int = 100,
               cpu_repeats: int = 5) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of fn(): do_bench on CUDA (``warmup_ms`` / ``rep_ms``
    of calls, do_bench's defaults; fewer keep a many-case run short), a
    wall-clock loop of ``cpu_repeats`` calls on CPU (one under the Triton
    interpreter, where a call takes seconds and the time means nothing)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))

    def cpu_timer(fn) -> float:
        fn()  # warm-up
        samples = []
        for _ in range(cpu_repeats):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    return cpu_timer


def copy_bandwidth_gbps(device: torch.device, timer, nbytes: int) -> float:
    """Read + write bandwidth of a plain tensor copy on ``device``."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def time_or_none(timer, fn) -> float | None:
    """Time a baseline; None if it cannot run (e.g. out of memory)."""
    try:
        return timer(fn)
    except (RuntimeError, TypeError):  # OOM is a RuntimeError; TypeError: torch without enable_gqa
        return None
