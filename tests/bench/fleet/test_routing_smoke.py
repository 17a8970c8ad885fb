"""`pagedserve bench fleet --routing` end to end on the tiny model: two real replicas,
each mode's real front (vllm-router from its wheel, Debian's nginx), a couple of
conversations per mode. Only the report's shape and sanity are checked, never
timings; the oracle and the nginx rendering are checked exactly on their own."""

from __future__ import annotations

import json

import pytest
from need import need

from bench.fleet import fleet
from bench.fleet.routing_fronts import MODES, missing_tools, render_nginx
from bench.fleet.routing_report import ideal_cached


def test_every_mode_reports_sane_numbers(tiny_llama_path, tmp_path):
    for tool in missing_tools(MODES):
        need(False, f"{tool} is not installed")
    out = tmp_path / "routing.json"
    argv = ["--routing", "--model", str(tiny_llama_path), "--replicas", "2", "--tenants", "2",
            "--tenant-words", "40", "--conversations", "2", "--turns", "2", "--rate", "20",
            "--think-seconds", "0.05", "--max-tokens", "3", "--replica-kv-bytes", str(4 << 20),
            "--max-model-len", "256", "--log-dir", str(tmp_path / "logs"), "--output", str(out),
            "--server-args", "--device", "cpu", "--dtype", "float32"]
    assert fleet.main(argv) == 0
    report = json.loads(out.read_text())
    assert [m["mode"] for m in report["modes"]] == list(MODES)
    for mode in report["modes"]:
        assert mode["failed"] == 0 and mode["requests"] == 4, mode["mode"]
        assert sum(mode["per_replica"]) == 4 and len(mode["per_replica"]) == 2
        assert 1.0 <= mode["max_share"] <= 2.0
        assert 0 <= mode["hit_rate"] <= 1 and mode["hit_of_ideal"] >= 0
        assert 0 <= mode["cached_tokens"] <= mode["prompt_tokens"]
        assert 0 < mode["ttft_p50_s"] <= mode["ttft_p90_s"]
        assert mode["output_tokens_per_s"] > 0 and mode["token_count_mismatches"] == 0
        # each conversation's second turn quotes its first: the oracle has that prefix
        seconds = [r for r in mode["requests_detail"] if r["turn"] == 1]
        assert all(r["ideal_cached"] >= 16 for r in seconds)
        # Each mode starts cold on the same replicas (their caches reset between
        # modes): no request finds more cached than this mode's own earlier
        # requests could have left.
        assert all(r["cached_tokens"] <= r["ideal_cached"] for r in mode["requests_detail"]), (
            mode["mode"], [(r["cached_tokens"], r["ideal_cached"]) for r in mode["requests_detail"]])
    assert set(report["targets"]) == {"hit_of_ideal_at_least_90pct", "max_share_at_most_1.5",
                                      "p90_ttft_at_most_fifth_of_round_robin",
                                      "p90_ttft_at_most_nginx"}
    assert report["command"][:4] == ["pagedserve", "bench", "fleet", "--routing"]


def record(conversation, turn, sent, tokens, completion=0, error=""):
    return {"conversation": conversation, "turn": turn, "sent": sent, "tokens": tokens,
            "prompt_tokens": len(tokens), "completion_tokens": completion, "error": error}


def test_the_ideal_counts_earlier_prompts_and_the_previous_answer_in_whole_blocks():
    system = list(range(100, 140))  # 40 tokens: 2 whole blocks of 16
    first = record(0, 0, 0.0, system + [1, 2, 3], completion=20)
    # the follow-up quotes the first prompt and its 20-token answer, then asks again
    follow = record(0, 1, 5.0, first["tokens"] + list(range(500, 520)) + [7] * 30)
    same_tenant = record(1, 0, 1.0, system + [9] * 10)
    other = record(2, 0, 2.0, list(range(300, 350)))
    failed = record(3, 0, 0.5, list(range(300, 350)), error="ReadTimeout")
    ideal = ideal_cached([first, follow, same_tenant, other, failed], 16)
    assert ideal[0] == 0  # nothing came before it
    assert ideal[1] == (43 + 20 - 1) // 16 * 16  # 48: the prompt and the answer but its last token
    assert ideal[2] == 32  # the system prompt's whole blocks
    assert ideal[3] == 0  # a failed request holds nothing
    assert ideal[4] == 0
    # never more than the prompt less one token
    again = record(4, 0, 9.0, list(system))
    assert ideal_cached([first, again], 16)[1] == 32
    exact = record(5, 0, 9.0, list(range(100, 132)))
    assert ideal_cached([first, exact], 16)[1] == 16


@pytest.mark.parametrize("count", [2, 3])
def test_nginx_gets_one_server_line_per_replica_in_each_upstream(count):
    from bench.fleet.routing_fronts import NGINX_TEMPLATE

    hosts = [f"127.0.0.1:{9000 + i}" for i in range(count)]
    text = render_nginx(NGINX_TEMPLATE.read_text(), hosts, "127.0.0.1:8999")
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not any("${" in line for line in code) and "    listen 127.0.0.1:8999;" in code
    for host in hosts:
        assert text.count(f"server {host} ") == 2  # by session, and least connections
    assert "hash $http_x_session_id consistent;" in text
