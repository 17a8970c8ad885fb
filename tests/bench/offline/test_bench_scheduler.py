"""Smoke test of `pagedserve bench scheduler`: a few steps at small sizes, through
the CLI, then the JSON. No model and no timing asserts (shared machines are noisy)."""

from __future__ import annotations

import json

import pytest

from bench.offline import scheduler as bench
from pagedserve.cli import main as cli_main

SIZES = [1, 8]
ADMISSION_RUNNING = 4


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-scheduler") / "scheduler.json"
    argv = ["bench", "scheduler", "--steps", "4", "--warmup", "1", "--sizes", "1,8",
            "--prompt-len", "40", "--burst", "3", "--admission-running", str(ADMISSION_RUNNING),
            "--output", str(out)]
    assert cli_main(argv) == 0
    return json.loads(out.read_text())


def test_report_has_every_case(report):
    assert report["benchmark"] == "scheduler"
    assert report["settings"]["steps"] == 4 and report["settings"]["block_size"] == 16
    cases = [(r["mode"], r["prefix_caching"], r["case"], r["num_running"])
             for r in report["results"]]
    expected = [(mode, caching, "decode", n) for mode in bench.MODES for caching in (False, True)
                for n in SIZES]
    expected += [(mode, caching, "admission", ADMISSION_RUNNING) for mode in bench.MODES
                 for caching in (False, True)]
    assert sorted(cases) == sorted(expected)
    for r in report["results"]:
        assert r["steps"] == 4
        assert 0 <= r["median_us"] <= r["p90_us"] <= r["max_us"]
        assert 0 <= r["cpu_median_us"] <= r["cpu_p90_us"]
        assert r["us_per_seq"] >= 0 and r["preemptions"] == 0
    assert set(report["target"]) == {"target_us", "num_running", "met"}


def test_decode_cases_are_steady_state(report):
    for r in report["results"]:
        if r["case"] == "decode":
            # every running sequence decodes one token in every timed step
            assert r["mean_seqs_per_step"] == r["num_running"]
            assert r["mean_tokens_per_step"] == r["num_running"]
            assert r["admitted"] == 0


def test_admission_cases_admit_and_hit_the_shared_prompt(report):
    for r in report["results"]:
        if r["case"] == "admission":
            assert r["admitted"] > 0 and r["add_us_per_seq"] > 0
            assert r["mean_seqs_per_step"] > ADMISSION_RUNNING
            assert r["mean_tokens_per_step"] > r["mean_seqs_per_step"]  # prefill chunks
            assert (r["prefix_cache_hit_rate"] > 0) == r["prefix_caching"]


def test_subsets_and_bad_arguments(tmp_path):
    out = tmp_path / "one.json"
    argv = ["--steps", "2", "--warmup", "0", "--sizes", "2", "--cases", "decode",
            "--caching", "on", "--modes", "scheduler", "--prompt-len", "20", "--output", str(out)]
    assert bench.main(argv) == 0
    [result] = json.loads(out.read_text())["results"]
    assert (result["case"], result["mode"], result["prefix_caching"]) == \
        ("decode", "scheduler", True)
    with pytest.raises(SystemExit):
        bench.main(["--modes", "model"])
    with pytest.raises(ValueError):
        bench.main(["--steps", "0"])
