"""Speculative decoding behind the HTTP API: a server started with vLLM's
--speculative-config streams several tokens per chunk on grounded text, says
how many in each chunk's usage (continuous_usage_stats), answers what it
answers without drafts, and counts drafts in /metrics."""

from __future__ import annotations

import json

import pytest

from engine.config import EngineConfig
from live_server import run_server
from service.cli import build_parser, service_config_from_args
from service.config import ServiceConfig

PASSAGE = ("Fishing boats slip out past the stone breakwater while the bakery on the "
           "corner fires its ovens, and by the time the market opens the first crates "
           "of mackerel are already stacked on the quay.")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
BODY = {"messages": [{"role": "user", "content": f"Quote this passage exactly:\n\n{PASSAGE}"}],
        "max_tokens": 48, "temperature": 0}


def engine_config(**changes) -> EngineConfig:
    # No prefix caching: each request computes its whole prompt, so two answers
    # differ only by the drafts.  With it, a repeated prompt's last tokens run
    # alone through the few-token path, and on AVX2 (where a prompt past 47
    # tokens takes the fp32 strips, quant_strips.h) the 8-bit rounding of the
    # activations turns that summation order into a logprob change of ~0.1:
    # this prompt's third token is a near-tie (0.024 apart) that flipped.
    return EngineConfig(model="smollm2-135m-instruct", max_model_len=1024, dtype="float32",
                        kv_cache_memory_bytes=64 << 20, num_threads=1,
                        enable_prefix_caching=False, **changes)


@pytest.fixture(scope="module")
def spec_server(smollm2_path):
    with run_server(ServiceConfig(engine=engine_config(speculative_config=NGRAM))) as live:
        yield live


def stream_chunks(client, body) -> list[dict]:
    chunks = []
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def test_chunks_carry_several_tokens_and_say_how_many(spec_server):
    body = {**BODY, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with spec_server.client() as client:
        chunks = stream_chunks(client, body)
        whole = client.post("/v1/chat/completions", json=BODY).json()
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    steps = [b - a for a, b in zip([0, *counts], counts)]
    assert max(steps) > 1, "no chunk carried an accepted draft"
    assert counts == sorted(counts) and chunks[-1]["usage"]["completion_tokens"] == counts[-1]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert whole["usage"]["completion_tokens"] == counts[-1]


def test_the_same_answer_as_a_server_without_drafts(spec_server, smollm2_path):
    with spec_server.client() as client:
        speculative = client.post("/v1/chat/completions", json=BODY).json()
    with run_server(ServiceConfig(engine=engine_config())) as plain, plain.client() as client:
        expected = client.post("/v1/chat/completions", json=BODY).json()
        assert "pagedserve:spec_decode_num_drafts_total" not in plain.metrics()
    assert speculative["choices"][0]["message"] == expected["choices"][0]["message"]


def test_metrics_count_drafts_and_accepted_tokens_by_position(spec_server):
    with spec_server.client() as client:
        client.post("/v1/chat/completions", json=BODY)
        text = client.get("/metrics").text
    metrics = spec_server.metrics()
    drafted = metrics["pagedserve:spec_decode_num_draft_tokens_total"]
    accepted = metrics["pagedserve:spec_decode_num_accepted_tokens_total"]
    assert metrics["pagedserve:spec_decode_num_drafts_total"] > 0 and 0 < accepted <= drafted
    per_position = [line for line in text.splitlines()
                    if line.startswith("pagedserve:spec_decode_num_accepted_tokens_per_pos_total{")]
    assert len(per_position) == NGRAM["num_speculative_tokens"]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in per_position) == accepted


def test_a_bad_speculative_config_is_refused_at_start_naming_the_key(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "eagle"}'])
    assert "speculative_config.method='eagle' is not supported" in capsys.readouterr().err
    args = parser.parse_args(["--speculative-config", '{"method": "suffix"}'])
    assert service_config_from_args(args).engine.speculative_config.method == "suffix"
