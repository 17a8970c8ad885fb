"""tests/lanes.py: every test module runs in exactly one lane of `make test`."""

from pathlib import Path

from lanes import LANES, lane_files

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_runs_in_exactly_one_lane():
    found = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py"))
    lanes = {lane: lane_files(lane) for lane in (*LANES, "parallel")}
    listed = [path for files in lanes.values() for path in files]
    assert sorted(listed) == found  # none left out, none run twice


def test_the_parallel_lane_starts_with_its_longest_modules():
    from lanes import PARALLEL_FIRST

    files = lane_files("parallel")
    assert files[:len(PARALLEL_FIRST)] == list(PARALLEL_FIRST)
    assert files[len(PARALLEL_FIRST):] == sorted(files[len(PARALLEL_FIRST):])
