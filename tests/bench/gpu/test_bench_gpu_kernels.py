"""`python -m bench.gpu.gpu_kernels --device cpu --small`: the GPU bandwidth
benchmark of the new Triton kernels (GGUF GEMM, multi-LoRA, int8 / fp8 KV
decode) in its smoke mode, under the interpreter in a child process (the
interpreter must be on before triton is imported, and a crash in it must
fail this test, not kill pytest). Every case has to run and every row to
match its reference: on the GPU machine the same code runs once, at full
size, with no second try. Timings are never asserted (the interpreter's mean
nothing)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from need import need

REPO = Path(__file__).resolve().parents[3]


def test_gpu_kernels_smoke_rows_all_match_their_references(tmp_path):
    need(importlib.util.find_spec("triton") is not None, "triton is not installed")
    need(importlib.util.find_spec("gguf") is not None, "gguf is not installed")
    output = tmp_path / "new-kernels.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu.gpu_kernels", "--device", "cpu", "--small",
         "--output", str(output)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    report = json.loads(output.read_text())
    rows = report["rows"]
    assert report["ok"] and report["skipped"] == []
    assert [r for r in rows if not r["ok"] or "error" in r] == []
    kinds = {(r["kernel"], r["case"].split()[0]) for r in rows}
    assert {("quant_linear", t) for t in report["sizes"]["quant_types"]} <= kinds
    # int8_aN: the rows in a padded view N bytes apart (paged_attention.row_align's hint)
    assert {("decode", c) for c in ("float32", "int8", "int8_a4", "int8_a8", "int8_a16", "float8_e4m3fn")} <= kinds
    assert {k for k, _ in kinds} == {"quant_linear", "lora_shrink", "lora_expand", "decode"}
    for row in rows:
        assert row["bytes"] > 0 and row["ms"] > 0 and row["fraction_of_copy"] > 0, row
        assert row["max_abs_err"] >= 0, row
    quant = [r for r in rows if r["kernel"] == "quant_linear"]
    assert all(r["dequantize_exact"] and r["launch_matches_entry"] and r["entry_ms"] > 0 for r in quant)
    assert all(r["baseline_ms"] is not None for r in rows if r["kernel"] == "quant_linear")
