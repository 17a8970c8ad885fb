"""The engine on the Triton kernels (through the CPU interpreter) against HF and the reference.

The interpreter must be switched on before triton is imported, and an
interpreter crash must fail a test rather than kill the suite, so the run
happens in a child process: `bench.gpu.gpu_check --small`, the same check the GPU
machine runs at full size.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from need import need
from engine import LLM

REPO = Path(__file__).resolve().parents[2]


def test_triton_backend_matches_hf_and_reference(tmp_path):
    need(importlib.util.find_spec("triton") is not None, "triton is not installed")
    output = tmp_path / "e2e.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu.gpu_check", "--device", "cpu", "--small",
         "--block-sizes", "1,16", "--output", str(output)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    report = json.loads(output.read_text())
    assert report["ok"]
    assert [run["block_size"] for run in report["runs"]] == [1, 16]
    for run in report["runs"]:
        for key in ("triton_vs_hf", "torch_vs_hf", "triton_vs_torch"):
            assert run[key]["failures"] == [], (key, run)
        # Same kernels contract, same fp32 maths: the two engine runs agree exactly.
        assert run["triton_vs_torch"]["exact"] == len(report["prompt_lengths"])


def test_triton_backend_refuses_unsupported_head_dim(tiny_llama_path, monkeypatch):
    """The tiny model's head_dim is 16: the Triton kernels take 64/80/96/128/256."""
    need(importlib.util.find_spec("triton") is not None, "triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # so the device is not what it objects to
    with pytest.raises(ValueError, match=r"head_dim must be one of \(64, 80, 96, 128, 256\), got 16"):
        LLM(str(tiny_llama_path), kernel_backend="triton")

