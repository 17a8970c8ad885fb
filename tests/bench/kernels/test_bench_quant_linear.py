"""`python -m bench.kernels.quant_linear --layout both` on a small shape: a
row per layout and count, then the alternated pairs' ratio. Timings are never
asserted against a bound (shared CI machines are noisy)."""

from __future__ import annotations

import re

import torch

from bench.kernels import quant_linear
from kernels.cpu import ops as cpu_ops
from need import need


def test_both_layouts_then_their_pairs(monkeypatch):
    monkeypatch.setattr(quant_linear, "COLD_BYTES", 1 << 16)  # a few copies, not 64 MB of them
    timed = quant_linear._micros
    monkeypatch.setattr(quant_linear, "_micros", lambda fn, copies, seconds=0.0: timed(fn, copies, 0.005))
    ops = cpu_ops.current_ops()
    need(ops is not None, "the compiled CPU ops are not built (make install)")
    generator = torch.Generator().manual_seed(0)
    lines = quant_linear.bench_shape(ops, "tiny", "Q4_1", 64, 32, [1, 3], generator, ("file", "engine"))
    assert [line.split(" | ")[0] for line in lines] == [
        "| tiny Q4_1 64->32 (file)", "| tiny Q4_1 64->32 (file)",
        "| tiny Q4_1 64->32 (engine)", "| tiny Q4_1 64->32 (engine)",
        "| tiny Q4_1 64->32 (file / engine, 8 pairs)", "| tiny Q4_1 64->32 (file / engine, 8 pairs)"]
    assert "GB/s" in lines[0] and "GB/s" not in lines[1]
    for line, m in zip(lines[4:], (1, 3)):
        median, low, high = map(float, re.search(r"\| ([\d.]+)x \(([\d.]+)-([\d.]+)\)", line).groups())
        assert line.split(" | ")[1] == str(m) and 0 < low <= median <= high
