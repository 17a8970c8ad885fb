"""`bench output-overhead` end to end on a short stream (timings are never asserted)."""

from __future__ import annotations

import json

import pytest

from bench.offline import output_overhead


def test_short_run_writes_every_case(tmp_path):
    out = tmp_path / "overhead.json"
    argv = ["--tokens", "60", "--marks", "20,60", "--window", "10", "--repeats", "2",
            "--output", str(out)]
    assert output_overhead.main(argv) == 0
    report = json.loads(out.read_text())
    cases = {(r["kind"], r["logprobs"]) for r in report["results"]}
    assert cases == {(k, lp) for k in ("cumulative", "delta") for lp in (False, True)}
    for r in report["results"]:
        for clock in ("wall_us", "cpu_us"):
            assert set(r[clock]) == {"20", "60"} and all(v > 0 for v in r[clock].values())


def test_marks_beyond_the_stream_are_refused():
    with pytest.raises(ValueError, match="beyond --tokens"):
        output_overhead.main(["--tokens", "50", "--marks", "100"])
