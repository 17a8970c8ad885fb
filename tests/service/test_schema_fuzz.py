"""Fuzzing the server with its own /openapi.json (schemathesis + hypothesis).

/openapi.json is generated from the msgspec Structs that decode requests, so
a fuzzer that follows it explores exactly the space of requests the server
accepts (positive cases) and, mutated, the ones it must refuse (negative
cases). For every operation schemathesis sends its coverage cases (each
field at and just past its bounds, missing required fields, wrong types,
odd content types) and then a bounded number of hypothesis cases, positive
and negative. Whatever it sends, the server must

  * never answer 5xx, nor put an internal error inside an event stream;
  * answer with a status, content type and (JSON) body its schema declares,
    and every event of a stream must be a well-formed chunk ending in [DONE];
  * refuse a schema-invalid request with 4xx;

and afterwards still be healthy, serve a normal request, and hold no request
and no KV block. The runs are derandomized: the same cases every time, so a
failure reproduces (schemathesis prints a curl command for it).
"""

from __future__ import annotations

import copy
from collections import Counter

import httpx
import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance, negative_data_rejection, response_schema_conformance,
    status_code_conformance,
)

from engine.config import EngineConfig
from live_server import run_server, wait_until
from service.app import VERSION
from service.config import ServiceConfig
from service.openapi import build_openapi
from service.protocol.replies import ChatCompletionChunk, CompletionResponse, ErrorResponse
from service.responses.protocol import ResponseObject
from need import need

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MODEL = "/v1/models/{model_id}"
SERVED = "tiny"  # the fuzz server's model name
# What /openapi.json serves (checked below), built here so that schemathesis can
# parametrize the tests at collection time, before any server runs.
SPEC = build_openapi("pagedserve", VERSION)
OPERATIONS = sorted((method.upper(), path) for path, item in SPEC["paths"].items()
                    for method in item)


def _fuzz_spec() -> dict:
    """SPEC, plus what the server enforces or knows but the schema does not state.

    The server refuses an empty prompt string ("the prompt is empty", 400)
    while the schema allows "". Schemathesis' coverage phase holds the prompt
    at its minimal value "" while it varies every other field, so without this
    no coverage case of /v1/completions would ever get past the prompt check.
    Likewise the model route knows one id, which no generated string would hit:
    it is given as an example, so its 200 is fuzzed too and not only its 404.
    """
    spec = copy.deepcopy(SPEC)
    prompt = spec["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    (text,) = [option for option in prompt["anyOf"] if option.get("type") == "string"]
    text["minLength"] = 1
    (model_id,) = spec["paths"][MODEL]["get"]["parameters"]
    model_id["example"] = SERVED
    return spec


# Read every event of a stream (schemathesis stops after 20 by default): a
# case's stream is at most ~65 events with this server's 96-token context.
schema = schemathesis.openapi.from_dict(
    _fuzz_spec(), config=schemathesis.Config.from_dict({"max-stream-events": 10_000}))

STREAM_TYPES = {CHAT: ChatCompletionChunk, COMPLETIONS: CompletionResponse}
BASE_CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
               negative_data_rejection]
# What the fuzzing saw, per (operation, positive/negative, status): checked at the end.
SEEN: Counter = Counter()


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama_path):
    # A short context bounds the decode of each accepted case (at most ~60 new
    # tokens after the chat template), which keeps the hundreds of cases quick.
    engine = EngineConfig(model=str(tiny_llama_path), max_model_len=96, max_num_seqs=64,
                          kv_cache_memory_bytes=64 << 20, seed=0)
    # Fuzzing sends hundreds of refusals back to back: unpaced here, so each
    # case is answered at once (pacing has its own tests, test_pacing.py).
    config = ServiceConfig(engine=engine, served_model_name=SERVED, refusal_rate=0.0)
    with run_server(config) as live:
        yield live


def check_stream(path: str, response) -> None:
    """Every event of a stream is a chunk of the right type; it ends with [DONE]
    (a Responses stream: with response.completed, .incomplete or .failed)."""
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return
    assert not response.stream_cut_short, "schemathesis stopped reading this stream"
    content = response.content
    events = [line[len(b"data: "):] for line in content.split(b"\n")
              if line.startswith(b"data: ")]
    if path == RESPONSES:
        check_response_events(events, content)
        return
    assert events and events[-1] == b"[DONE]", f"stream not terminated:\n{content[-500:]!r}"
    for payload in events[:-1]:
        if payload.startswith(b'{"error"'):
            error = msgspec.json.decode(payload, type=ErrorResponse).error
            assert error.type != "server_error", f"in-band server error: {error.message}"
        else:
            msgspec.json.decode(payload, type=STREAM_TYPES[path])


def check_response_events(events: list[bytes], content: bytes) -> None:
    """A Responses stream: numbered events, no server error, one response to the end."""
    decoded = [msgspec.json.decode(payload) for payload in events]
    assert decoded and decoded[-1]["type"] in (
        "response.completed", "response.incomplete", "response.failed"), content[-500:]
    assert [e["sequence_number"] for e in decoded] == list(range(len(decoded)))
    for event in decoded:
        assert event["type"] != "error" or event["code"] != "server_error", event
        if "response" in event:
            msgspec.convert(event["response"], type=ResponseObject)


# -- the schema ------------------------------------------------------------------------
def test_openapi_json_is_valid_openapi_31(fuzz_server):
    served = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json", timeout=30)
    served.validate()  # against the OpenAPI 3.1 meta-schema; raises on any violation
    assert served.raw_schema["openapi"] == "3.1.0"
    assert served.raw_schema == SPEC  # what the fuzzing below is generated from
    # Every operation resolves (each $ref included) to the routes the server has.
    operations = [result.ok() for result in served.get_all_operations()]
    assert sorted((op.method.upper(), op.path) for op in operations) == OPERATIONS
    for path in (CHAT, COMPLETIONS):
        assert served[path]["POST"].body, f"{path} declares no request body"


def test_request_schemas_publish_the_bounds(fuzz_server):
    components = httpx.get(f"{fuzz_server.url}/openapi.json", timeout=30).json()[
        "components"]["schemas"]

    def bounds(struct: str, field: str) -> dict:
        prop = components[struct]["properties"][field]
        options = [o for o in prop.get("anyOf", [prop]) if o.get("type") != "null"]
        assert len(options) == 1, prop
        return {k: v for k, v in options[0].items() if k != "default"}

    for struct in ("ChatCompletionRequest", "CompletionRequest"):
        assert bounds(struct, "temperature") == {"type": "number", "minimum": 0, "maximum": 2}
        assert bounds(struct, "top_p") == {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
        assert bounds(struct, "min_p") == {"type": "number", "minimum": 0, "maximum": 1}
        assert bounds(struct, "presence_penalty") == {
            "type": "number", "minimum": -2, "maximum": 2}
        assert bounds(struct, "repetition_penalty") == {
            "type": "number", "exclusiveMinimum": 0, "maximum": 10}
        # completions take 0 with echo (the prompt's logprobs, nothing generated)
        minimum = 0 if struct == "CompletionRequest" else 1
        assert bounds(struct, "max_tokens") == {"type": "integer", "minimum": minimum}
        assert bounds(struct, "top_k") == {"type": "integer", "minimum": -1, "maximum": 2**31 - 1}
        assert bounds(struct, "n") == {"type": "integer", "minimum": 1, "maximum": 16}
    chat = components["ChatCompletionRequest"]
    assert chat["required"] == ["messages"]
    assert chat["properties"]["messages"]["minItems"] == 1
    assert bounds("ChatCompletionRequest", "top_logprobs") == {
        "type": "integer", "minimum": 0, "maximum": 20}
    assert components["CompletionRequest"]["required"] == ["prompt"]
    roles = components["ChatMessage"]["properties"]["role"]
    assert set(roles["enum"]) == {"system", "developer", "user", "assistant", "tool"}


def test_the_published_bounds_are_the_enforced_ones(fuzz_server):
    """On each bound a request is served; just past it, a 400 names the field."""
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    url = f"{fuzz_server.url}{CHAT}"
    for field, bad, good in [("temperature", 2.01, 2), ("top_p", 0, 1), ("n", 17, 16),
                             ("top_k", -2, -1), ("max_tokens", 0, 1), ("min_p", 1.01, 1),
                             ("presence_penalty", -2.5, -2), ("repetition_penalty", 0, 10)]:
        refused = httpx.post(url, json={**base, field: bad}, timeout=60)
        assert refused.status_code == 400, (field, bad, refused.text)
        assert refused.json()["error"]["param"] == field
        accepted = httpx.post(url, json={**base, field: good}, timeout=60)
        assert accepted.status_code == 200, (field, good, accepted.text)


# -- the fuzzing -------------------------------------------------------------------------
@schema.parametrize()
@settings(
    max_examples=30,  # hypothesis cases per operation, on top of the coverage cases
    deadline=None,
    derandomize=True,
    database=None,
    # explicit = schemathesis' coverage cases; no shrinking, so a failing run stays short.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)
def test_fuzz(case, fuzz_server):
    response = case.call(base_url=fuzz_server.url, timeout=60)
    mode = case.meta.generation.mode.value if case.meta is not None else "explicit"
    SEEN[(case.operation.path, mode, response.status_code)] += 1
    content_type = response.headers.get("content-type", [""])[0]  # lowercase keys, lists
    checks = list(BASE_CHECKS)
    if content_type.startswith("application/json"):
        # Streams are checked below: schemathesis would read the "string" schema
        # declared for text/event-stream as the schema of each event.
        checks.append(response_schema_conformance)
    case.validate_response(response, checks=checks)
    check_stream(case.operation.path, response)


def test_fuzzing_reached_the_engine_and_found_no_server_error(fuzz_server):
    need(bool(SEEN), "the fuzzing tests did not run")
    assert not [key for key in SEEN if key[2] >= 500], SEEN
    # Every operation of the schema was fuzzed, the ones added since included.
    assert {path for path, _, _ in SEEN} == {path for _, path in OPERATIONS}, SEEN
    # The model route answered both ways: the card for the served id, 404 for others.
    assert {200, 404} <= {status for path, _, status in SEEN if path == MODEL}, SEEN
    for path in (CHAT, COMPLETIONS):
        for mode in ("positive", "negative"):
            assert sum(n for (p, m, _), n in SEEN.items() if (p, m) == (path, mode)) >= 20, (
                path, mode, SEEN)
        # Not only 400s: enough cases got through validation into the engine.
        assert SEEN[(path, "positive", 200)] >= 10, SEEN


def test_server_is_healthy_and_clean_after_fuzzing(fuzz_server):
    # Runs last in this module (definition order): after all the fuzzing above.
    url = fuzz_server.url
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    response = httpx.post(f"{url}{CHAT}", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 8, "ignore_eos": True, "temperature": 0,
    })
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8
    # Nothing the fuzzer sent is still running or holding KV blocks.
    state = fuzz_server.state

    def idle() -> bool:
        counters = state.engine.stats.counters
        return (counters["num_requests_running"] == 0 and counters["num_requests_waiting"] == 0
                and counters["kv_blocks_free"] == counters["kv_blocks_total"])

    assert wait_until(idle, timeout=10), state.engine.stats.counters
    assert not state.engine._streams
    assert state.engine.is_alive and not state.draining
