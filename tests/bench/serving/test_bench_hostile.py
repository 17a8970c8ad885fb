"""`bench hostile` end to end against a live tiny server (timings are never asserted)."""

from __future__ import annotations

import json

from bench.serving import hostile
from live_server import run_server, tiny_config


def test_short_run_reports_both_phases(tiny_llama_path, tmp_path):
    out = tmp_path / "hostile.json"
    with run_server(tiny_config(tiny_llama_path)) as live:
        argv = ["--url", live.url, "--kind", "tools", "--rounds", "1", "--phase-seconds", "1",
                "--stream-tokens", "40", "--output", str(out)]
        assert hostile.main(argv) == 0
    report = json.loads(out.read_text())
    assert [p["kind"] for p in report["phases"]] == ["idle", "hostile"]
    for name in ("chat_s", "gaps_s"):
        assert report[name]["idle_median"] > 0 and report[name]["hostile_median"] > 0
        assert len(report[name]["round_ratios"]) == 1
    assert set(report["hostile_answers"]) == {"400"}  # refused by their count


def test_the_tools_body_is_three_thousand_tools():
    body = json.loads(hostile.hostile_body("tools", 0, 0))
    assert len(body["tools"]) == 3000 and body["tool_choice"] == "required"
    first, second = (json.loads(hostile.hostile_body("schema", n, 0)) for n in (0, 1))
    assert first != second  # a new schema each time: no compile is a cache hit
