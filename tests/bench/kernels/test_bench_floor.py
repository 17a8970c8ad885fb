"""`pagedserve bench kernels --floor` on the tiny model: the report's fields and
its arithmetic (bandwidth from the timed reads, the floor from the weights'
bytes, the decode rate from the short and long runs). Timings are never
asserted against a bound (shared CI machines are noisy)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from bench.kernels import floor, kernels

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@pytest.fixture(scope="module")
def floor_report(tiny_llama_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-floor") / "floor.json"
    argv = ["--floor", "--floor-model", str(tiny_llama_path),
            "--floor-kv-cache-bytes", str(1 << 22), "--floor-read-bytes", str(1 << 24),
            "--floor-read-runs", "3", "--floor-tokens", "4", "--floor-repeats", "2",
            "--output", str(out)]
    assert kernels.main(argv) == 0
    return json.loads(out.read_text())


def checkpoint_elements(folder) -> int:
    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            names = list(f.keys())
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in names)
    return total


def test_floor_report_fields(floor_report):
    report = floor_report
    for key in ("model", "dtype", "device", "isa", "torch_threads", "loadavg", "read", "chunked_read",
                "decode", "chunked_ratio", "weights_bytes", "weights_mb", "read_gbps", "floor_ms_per_token",
                "measured_ms_per_token", "ratio", "target_ratio", "meets_target"):
        assert key in report, key
    assert report["isa"]["cpu"] in ("avx512_bf16", "avx512_vnni", "avx2", "other")
    assert report["torch_threads"] >= 1 and report["read"]["threads"] >= 1
    assert report["target_ratio"] == 1.5


def test_read_bandwidth_arithmetic(floor_report):
    read = floor_report["read"]
    assert read["bytes"] == 1 << 24 and read["runs"] == 6 and len(read["seconds"]) == 6  # 3 x 2
    assert all(s > 0 for s in read["seconds"])
    assert read["gbps_best"] == pytest.approx(read["bytes"] / min(read["seconds"]) / 1e9)
    assert read["gbps_median"] <= read["gbps_best"]
    assert floor_report["read_gbps"] == read["gbps_best"]


def test_weights_are_the_checkpoint_as_held(floor_report, tiny_llama_path):
    """Every checkpoint weight in the engine's dtype, plus RoPE's tables (the
    tiny model's head is untied: nothing shared)."""
    held = checkpoint_elements(tiny_llama_path) * DTYPE_BYTES[floor_report["dtype"]]
    assert floor_report["weights_bytes"] >= held
    assert floor_report["weights_bytes"] - held <= 2 * 1024 * 16 * 4  # cos/sin, head_dim 16
    assert floor_report["weights_mb"] == pytest.approx(floor_report["weights_bytes"] / 1e6)


def test_floor_and_ratio_arithmetic(floor_report):
    report, decode = floor_report, floor_report["decode"]
    assert report["floor_ms_per_token"] == pytest.approx(
        report["weights_bytes"] / report["read_gbps"] / 1e6)
    assert decode["tokens"] == 4 and decode["repeats"] == 2
    assert len(decode["short_seconds"]) == len(decode["long_seconds"]) == 2
    expected = (min(decode["long_seconds"]) - min(decode["short_seconds"])) / 4 * 1e3
    assert report["measured_ms_per_token"] == pytest.approx(expected)
    assert report["ratio"] == pytest.approx(report["measured_ms_per_token"]
                                            / report["floor_ms_per_token"])
    assert report["meets_target"] == (report["ratio"] <= 1.5)


def test_rounds_pair_reads_with_decodes(floor_report):
    report, decode, read = floor_report, floor_report["decode"], floor_report["read"]
    assert len(report["rounds"]) == 2
    for i, one in enumerate(report["rounds"]):
        seconds = read["seconds"][3 * i: 3 * i + 3]
        assert one["read_gbps"] == pytest.approx(read["bytes"] / min(seconds) / 1e9)
        ms = (decode["long_seconds"][i] - decode["short_seconds"][i]) / 4 * 1e3
        assert one["ms_per_token"] == pytest.approx(ms)
        floor_ms = report["weights_bytes"] / one["read_gbps"] / 1e6
        assert one["ratio"] == pytest.approx(ms / floor_ms)
        chunked = report["chunked_read"]["seconds"][3 * i: 3 * i + 3]
        assert one["chunked_ms"] == pytest.approx(min(chunked) * 1e3)
    assert max(r["read_gbps"] for r in report["rounds"]) == pytest.approx(report["read_gbps"])


def test_floor_numbers_by_hand():
    read = {"gbps_best": 50.0}
    decode = {"ms_per_token": 8.0}
    numbers = floor.floor_numbers(read, 250_000_000, decode)
    assert numbers["floor_ms_per_token"] == pytest.approx(5.0)  # 250 MB at 50 GB/s
    assert numbers["ratio"] == pytest.approx(1.6) and not numbers["meets_target"]
    numbers = floor.floor_numbers(read, 250_000_000, {"ms_per_token": 7.5})
    assert numbers["ratio"] == pytest.approx(1.5) and numbers["meets_target"]
    numbers = floor.floor_numbers(read, 250_000_000, {"ms_per_token": 7.5}, gguf=True)
    assert numbers["target_ratio"] == 1.3 and not numbers["meets_target"]
    numbers = floor.floor_numbers(read, 250_000_000, {"ms_per_token": 6.5}, gguf=True)
    assert numbers["meets_target"]


def test_read_bandwidth_reads_the_whole_buffer():
    read = floor.read_bandwidth(1 << 20, 2, torch.device("cpu"))
    assert read["bytes"] == 1 << 20 and read["gbps_best"] > 0
    assert read["threads"] == torch.get_num_threads()


def test_chunked_read_arithmetic(floor_report):
    """The same bytes as the weights, a reduction per tensor of >= 64 KiB
    plus one for the rest, best of each run (3 a round, 2 rounds)."""
    chunked, report = floor_report["chunked_read"], floor_report
    assert chunked["runs"] == 6 and len(chunked["seconds"]) == 6
    assert abs(chunked["bytes"] - report["weights_bytes"]) <= 4 * chunked["chunks"]
    assert chunked["ms_best"] == pytest.approx(min(chunked["seconds"]) * 1e3)
    assert chunked["gbps_best"] == pytest.approx(chunked["bytes"] / min(chunked["seconds"]) / 1e9)
    assert report["chunked_ratio"] == pytest.approx(report["measured_ms_per_token"] / chunked["ms_best"])


def test_step_chunks_by_hand():
    """Each tensor of >= 64 KiB its own chunk in the model's order (parameters,
    then buffers), the small ones summed into one more."""
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 8))
    model.register_buffer("table", torch.zeros(32, 1024))
    chunks = floor.step_chunks(model)
    # 128 KiB weight; 1 KiB bias; 8 KiB weight; 32 B bias; 128 KiB buffer.
    assert chunks == [128 * 1024, 128 * 1024, 1024 + 8 * 1024 + 32]
    assert floor.step_chunks(torch.nn.Linear(128, 256, bias=False)) == [128 * 1024]


def test_chunk_views_are_consecutive():
    buffer = torch.arange(100, dtype=torch.float32)
    views = floor.chunk_views(buffer, [40, 2, 200])  # 10 floats, at least 1, 50
    assert [v.numel() for v in views] == [10, 1, 50]
    assert [int(v[0]) for v in views] == [0, 10, 11]
    assert floor.time_chunked_reads(views, 2)[0] > 0
