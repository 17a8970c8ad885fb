"""Where one decode step's GPU time goes (bench/gpu/gpu_graphs.py's itl part):
one bs-1 graph replay's wall time, its kernels by torch's profiler summed by
kind, and the linear layers alone at one row, so the gap to the HBM floor
splits into the products' time, the small kernels' and the idle time
between kernels.
"""

from __future__ import annotations

from collections import defaultdict

import torch

# Kernel name fragments -> kind (first match wins); anything else is "other".
KINDS = (("gemv", "linear"), ("gemm", "linear"), ("cutlass", "linear"), ("sm90_xmma", "linear"),
         ("splitk", "linear"), ("_split_sum", "linear"), ("decode", "attention"),
         ("prefill", "attention"), ("store_kvcache", "kv store"), ("rms", "norm"),
         ("rope", "rope"), ("act_and_mul", "activation"), ("silu", "activation"),
         ("memcpy", "copy"), ("elementwise", "element-wise (torch)"),
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


def replay_ms(runner, context: int, timer) -> tuple[float | None, dict | None]:
    """One bs-1 graph replay (a sequence of `context` tokens over real blocks, no
    store): its time, and its kernels' GPU time by kind (bench/gpu/step_profile.py)."""
    graphs = runner.graphs
    if graphs is None or 1 not in graphs.graphs:
        return None, None
    inputs, blocks = graphs.inputs, -(-context // runner.block_size)
    inputs.slots.fill_(-1)
    inputs.lens[:1].fill_(context)
    inputs.tables[0, :blocks] = torch.arange(1, blocks + 1, dtype=torch.int32)
    return timer(lambda: graphs._replay(1)), profile_replay(lambda: graphs._replay(1))


def linear_ms(model, timer, device, product=None) -> float:
    """The model's linear layers (LM head included) at one row, each shape timed
    once: cuBLAS's product, or `product` (the runner's kernels.linear)."""
    from engine.model.layers.linear import Linear

    product = product or torch.nn.functional.linear
    counts: dict[tuple, list] = {}
    for module in model.modules():
        if isinstance(module, Linear):
            counts.setdefault(tuple(module.weight.shape), [module.weight, 0])[1] += 1
    total = 0.0
    for weight, count in counts.values():
        x = torch.randn(1, weight.shape[-1], dtype=weight.dtype, device=device)
        total += count * timer(lambda x=x, weight=weight: product(x, weight))
    return total
