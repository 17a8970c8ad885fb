"""Attention features in the kernel benchmark (bench/kernels/kernels.py): one row each.

``window``  decode with a sliding window of ``--window`` tokens over a
            ``--feature-context`` context (default 512 of 4096), against the
            same decode without one.  GB/s counts the K/V the window needs
            (batch x window tokens); the baseline's, the whole context.  A
            kernel that skips the blocks before the window takes about
            window / context of the time.
``softcap`` decode with Gemma 2's ``--soft-cap`` on the scores, against the
            same decode without it (the cost of the tanh).
"""

from __future__ import annotations

import torch

from bench.kernels.kernel_rows import make_row, sequential_cache

FEATURE_KERNELS = ("window", "softcap")


def add_feature_args(parser) -> None:
    group = parser.add_argument_group("feature rows (kernels window, softcap)")
    group.add_argument("--feature-batch", type=int, default=8)
    group.add_argument("--feature-context", type=int, default=4096)
    group.add_argument("--window", type=int, default=512, help="sliding window, tokens")
    group.add_argument("--soft-cap", type=float, default=50.0, help="logits soft cap")


def feature_plan(kernels, args) -> list[tuple[str, int, int]]:
    """(kernel, batch, context) of the feature rows asked for."""
    return [(k, args.feature_batch, args.feature_context) for k in kernels if k in FEATURE_KERNELS]


def bench_feature(kernel: str, shape, backend, timer, batch: int, context: int, args):
    """One feature's decode row, the same decode without it as the baseline."""
    k_cache, v_cache, tables = sequential_cache(shape, batch, context)
    lens = torch.full((batch,), context, dtype=torch.int32, device=shape.device)
    query = torch.randn(batch, shape.num_heads, shape.head_dim, dtype=shape.dtype, device=shape.device)
    scale = shape.head_dim ** -0.5
    name, value = ("sliding_window", args.window) if kernel == "window" else ("logits_soft_cap",
                                                                              args.soft_cap)
    ms = timer(lambda: backend.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale,
                                                      **{name: value}))
    base_ms = timer(lambda: backend.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale))
    read = min(value, context) if kernel == "window" else context
    nbytes = shape.kv_bytes(batch * read) + 2 * shape.q_bytes(batch)
    row = make_row(f"decode {name}={value:g}", batch, context, ms, base_ms, f"decode, no {kernel}",
                   nbytes, None, {name: value})
    row.baseline_gbps = (shape.kv_bytes(batch * context) + 2 * shape.q_bytes(batch)) / base_ms / 1e6
    return row
