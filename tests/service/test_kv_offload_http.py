"""KV offload over HTTP on SmolLM2's real weights in float32 (its first 4
layers: conftest's smollm2_short_path): each tier (host, disk, Redis) changes
what is computed, never what is generated, and /metrics shows it.

Four distinct system prompts (~180 tokens, 11 full blocks of 16 once rendered)
go round three times, one request after another, each time with a new user
question. The device pool (33 usable blocks: one max_model_len=256 sequence
plus about one more prompt's worth) holds two and a half requests, so every
prefix has been evicted by the time it comes round again. Round 1 computes a
prefix, round 2 (its second sighting) stores it in the tier, round 3 loads it
back. Every run is compared token for token with the same workload served
with offloading off, on a server of its own.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from live_server import LiveServer, run_server, wait_until
from redis_server import start_redis
from service.config import ServiceConfig

BLOCK = 16
TOPICS = ("lighthouse", "orchard", "observatory", "bakery")
QUESTIONS = ("What is rule 3?", "Which note goes with rule 7?", "How many rules are there?")
ROUNDS = len(QUESTIONS)
MAX_TOKENS = 8


def system_prompt(k: int) -> str:
    topic = TOPICS[k]
    return " ".join(f"Rule {i + 1} of the {topic}: keep note number {i * 7 + k} in the "
                    f"{topic} ledger." for i in range(10))


def workload() -> list[list[dict]]:
    """Round by round, every prefix once: the order the requests are sent in."""
    return [[{"role": "system", "content": system_prompt(k)},
             {"role": "user", "content": f"{QUESTIONS[r]} (topic {k})"}]
            for r in range(ROUNDS) for k in range(len(TOPICS))]


def server_config(model_path, **offload) -> ServiceConfig:
    engine = EngineConfig(model=str(model_path), dtype="float32", seed=0, block_size=BLOCK,
                          max_model_len=256, num_gpu_blocks_override=34, max_num_seqs=2,
                          **offload)
    return ServiceConfig(engine=engine, served_model_name="smollm2")


def chat(client: httpx.Client, messages: list[dict]) -> dict:
    response = client.post("/v1/chat/completions", json={
        "model": "smollm2", "messages": messages, "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 0})
    assert response.status_code == 200, response.text
    return response.json()


def answer(body: dict) -> dict:
    """What must not change with offloading: the tokens (text and bytes), the text, usage."""
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    return {"tokens": [(t["token"], tuple(t["bytes"])) for t in content],
            "logprobs": [t["logprob"] for t in content],
            "text": choice["message"]["content"],
            "prompt_tokens": body["usage"]["prompt_tokens"],
            "completion_tokens": body["usage"]["completion_tokens"]}


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def serve_workload(model_path, **offload) -> tuple[list[dict], dict, int]:
    """The workload's responses, the server's /metrics after it (labelled samples too)
    and the full blocks the rounds of one prefix share."""
    with run_server(server_config(model_path, **offload)) as live:
        with live.client() as client:
            bodies = [chat(client, messages) for messages in workload()]
        # The engine thread's snapshot after the last step: every load and store is in.
        assert wait_until(lambda: metrics(live)[("pagedserve:num_requests_running", "")] == 0)
        return bodies, metrics(live), shared_prefix_blocks(live)


def metrics(live: LiveServer) -> dict[tuple[str, str], float]:
    """{(sample name, tier label or ""): value} of the server's /metrics."""
    text = httpx.get(f"{live.url}/metrics", timeout=30).text
    return {(sample.name, sample.labels.get("tier", "")): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples}


def shared_prefix_blocks(live: LiveServer) -> int:
    """Full blocks that the rounds of one prefix share, as the server's template renders them."""
    tokenizer = live.state.tokenizer
    rendered = [tokenizer.encode(tokenizer.apply_chat_template(m, tokenize=False,
                                                               add_generation_prompt=True),
                                 add_special_tokens=False)
                for m in workload()[::len(TOPICS)]]  # prefix 0 in each round
    common = 0
    while all(len(r) > common and r[common] == rendered[0][common] for r in rendered):
        common += 1
    return common // BLOCK


@pytest.fixture(scope="module")
def baseline(smollm2_short_path):
    bodies, values, blocks = serve_workload(smollm2_short_path)
    # The pool is too small to keep any prefix for its next round: nothing is cached.
    assert [cached(b) for b in bodies] == [0] * len(bodies)
    assert values[("pagedserve:prefix_cache_hits_total", "")] == 0
    assert not any(name.startswith("pagedserve:kv_offload") for name, _ in values)
    return [answer(b) for b in bodies], blocks


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.kill()


def tier_args(tier: str, tmp_path, redis_url: str | None) -> dict:
    if tier == "host":
        return {"kv_offload_host_bytes": 64 << 20}
    if tier == "disk":
        return {"kv_offload_disk_dir": str(tmp_path / "kv"), "kv_offload_disk_bytes": 64 << 20}
    return {"kv_offload_redis_url": redis_url}


@pytest.mark.parametrize("tier", ["host", "disk", "redis"])
def test_each_tier_serves_identical_outputs_with_hits(tier, baseline, smollm2_short_path, tmp_path,
                                                      request):
    redis_url = request.getfixturevalue("redis_url") if tier == "redis" else None
    bodies, values, blocks = serve_workload(smollm2_short_path, **tier_args(tier, tmp_path, redis_url))
    expected, baseline_blocks = baseline
    assert blocks == baseline_blocks
    assert blocks >= 8  # the system prompts fill most of the 256-token context
    answers = [answer(b) for b in bodies]
    assert [a["tokens"] for a in answers] == [e["tokens"] for e in expected]
    assert [a["text"] for a in answers] == [e["text"] for e in expected]
    assert [(a["prompt_tokens"], a["completion_tokens"]) for a in answers] == \
        [(e["prompt_tokens"], e["completion_tokens"]) for e in expected]
    assert all(a["completion_tokens"] == MAX_TOKENS for a in answers)
    for got, want in zip(answers, expected):  # the same float32 model, only chunked apart
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-3)

    # Rounds 1-2 compute everything; round 3 finds its prefix's shared blocks loaded.
    stored = len(TOPICS) * blocks
    assert [cached(b) for b in bodies] == \
        [0] * (2 * len(TOPICS)) + [blocks * BLOCK] * len(TOPICS)
    assert values[("pagedserve:kv_offload_hits_total", tier)] == stored
    assert values[("pagedserve:kv_offload_stores_total", tier)] == stored
    assert values[("pagedserve:kv_offload_tier_up", tier)] == 1
    assert values[("pagedserve:kv_offload_blocks_loaded_total", "")] == stored
    assert values[("pagedserve:kv_offload_blocks_load_failed_total", "")] == 0
    assert values[("pagedserve:kv_offload_bad_records_total", tier)] == 0
    assert values[("pagedserve:kv_offload_errors_total", tier)] == 0
    assert values[("pagedserve:prefix_cache_hits_total", "")] == stored * BLOCK
