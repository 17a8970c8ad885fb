"""Where one decode step's GPU time goes: the kernels of one bs-1 graph replay
(or of an eager forward, where no graph is captured), by torch's profiler,
summed by kind. bench/gpu/gpu_graphs.py's itl part reports it beside the
replay's wall time, so the gap to the HBM floor splits into the products'
time, the small kernels' and the idle time between kernels.
"""

from __future__ import annotations

from collections import defaultdict

import torch

# Kernel name fragments -> kind (first match wins); anything else is "other".
KINDS = (("gemv", "linear"), ("gemm", "linear"), ("cutlass", "linear"), ("sm90_xmma", "linear"),
         ("splitk", "linear"), ("_split_sum", "linear"), ("decode", "attention"),
         ("prefill", "attention"), ("store_kvcache", "kv store"), ("rms", "norm"),
         ("rope", "rope"), ("silu", "activation"), ("elementwise", "element-wise (torch)"),
         ("reduce", "reduction (torch)"), ("cat", "element-wise (torch)"))


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for fragment, kind in KINDS if fragment in lowered), "other")


def profile_replay(run, repeats: int = 5) -> dict:
    """The kernels `run()` launches, summed over `repeats` calls, per call: GPU
    microseconds by kind, the kernel count, the heaviest kernels by name."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    count = 0
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        micros = event.time_range.elapsed_us() / repeats
        by_kind[kind_of(event.name)] += micros
        by_name[event.name[:80]] += micros
        count += 1
    top = sorted(by_name.items(), key=lambda item: -item[1])[:12]
    return {"kernels_per_call": count / repeats, "gpu_us_per_call": sum(by_kind.values()),
            "by_kind_us": dict(sorted(by_kind.items(), key=lambda item: -item[1])),
            "top_kernels_us": dict(top)}
