"""No field silently ignored, tool results tied to their calls, failures counted
(issue 38): over HTTP to a real server on the tiny random Llama.

- an unknown top-level field is a 400 naming it, as OpenAI answers; vLLM's
  older guided_* fields are honoured as vLLM did;
- a tool message must answer a call an earlier assistant turn made;
- /metrics counts finished requests by reason and error answers by status/code.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from live_server import run_server, tiny_config, wait_until

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def live(tiny_llama_path):
    with run_server(tiny_config(tiny_llama_path, {"max_model_len": 1024})) as server:
        yield server


def post(live, path: str, body: dict) -> httpx.Response:
    base = {"messages": HELLO} if path == CHAT else {"prompt": "Hello"}
    return httpx.post(live.url + path, json={**base, "max_tokens": 4, **body}, timeout=120)


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    return choice["message"]["content"] if "message" in choice else choice["text"]


# -- row 4: unknown fields, and vLLM's guided_* ------------------------------------------
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("field, value", [
    ("foo", 1), ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "Hello"}), ("guided_decoding_backend", "x"),
])
def test_an_unknown_field_is_a_400_naming_it(live, path, field, value):
    error = error_of(post(live, path, {field: value}))
    assert (error["param"], error["code"]) == (field, "unknown_parameter"), error
    assert field in error["message"]


def test_the_sdk_gets_the_unknown_field_by_name(live):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", timeout=60)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2,
                                       extra_body={"foo": 1})
    assert caught.value.body["param"] == "foo"


def test_nested_objects_stay_lenient(live):
    """An assistant turn sent back as the SDK returned it (refusal, annotations...)."""
    history = [*HELLO, {"role": "assistant", "content": "Hi!", "refusal": None,
                        "annotations": [], "audio": None}, {"role": "user", "content": "Bye"}]
    assert post(live, CHAT, {"messages": history}).status_code == 200


@pytest.mark.parametrize("path, body, check", [
    (CHAT, {"guided_choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
    (COMPLETIONS, {"guided_regex": "(19|20)[0-9]{2}"},
     lambda text: re.fullmatch("(19|20)[0-9]{2}", text)),
    (COMPLETIONS, {"guided_grammar": 'root ::= "up" | "down"'},
     lambda text: text in ("up", "down")),
    (CHAT, {"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                            "required": ["ok"], "additionalProperties": False}},
     lambda text: isinstance(json.loads(text)["ok"], bool)),
    (CHAT, {"guided_json": json.dumps({"enum": ["red", "green"]})},
     lambda text: json.loads(text) in ("red", "green")),
    (COMPLETIONS, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"enum": [1, 2]}}}}, lambda text: json.loads(text) in (1, 2)),
])
def test_vllms_guided_fields_constrain_the_output(live, path, body, check):
    assert check(text_of(post(live, path, {**body, "max_tokens": 20, "temperature": 0})))


@pytest.mark.parametrize("body, param", [
    ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= root"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
])
def test_a_bad_or_doubled_guided_field_is_a_400_naming_it(live, body, param):
    assert error_of(post(live, CHAT, body))["param"] == param


# -- row 7: tool results answer a call ---------------------------------------------------
CALL = {"role": "assistant", "content": None, "tool_calls": [{
    "id": "call_1", "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


@pytest.mark.parametrize("messages, param", [
    ([*HELLO, CALL, {"role": "tool", "tool_call_id": "call_2", "content": "18 C"}],
     "messages[2].tool_call_id"),
    ([*HELLO, CALL, {"role": "tool", "content": "18 C"}], "messages[2].tool_call_id"),
    ([*HELLO, {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}, CALL],
     "messages[1].tool_call_id"),
])
def test_a_tool_message_that_answers_no_call_is_a_400(live, messages, param):
    error = error_of(post(live, CHAT, {"messages": messages}))
    assert error["param"] == param, error


def test_a_tool_message_that_answers_a_call_is_served(live):
    messages = [*HELLO, CALL, {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    assert post(live, CHAT, {"messages": messages}).status_code == 200


# -- row 9: outcomes in /metrics ---------------------------------------------------------
SAMPLE = re.compile(r'^pagedserve:(request_success|http_errors)_total\{(.*)\} (\S+)$')


def outcomes(live) -> dict[tuple[str, str], float]:
    """{(counter, labels): value} of the outcome counters, read over HTTP."""
    text = httpx.get(f"{live.url}/metrics", timeout=30).text
    return {(m.group(1), m.group(2)): float(m.group(3))
            for m in map(SAMPLE.match, text.splitlines()) if m}


def test_metrics_count_finished_requests_and_error_answers(live):
    before = outcomes(live)
    assert all(("request_success", f'finished_reason="{reason}"') in before
               for reason in ("stop", "length", "abort", "error"))
    assert post(live, CHAT, {"n": 2, "ignore_eos": True}).status_code == 200  # 2 x length
    assert post(live, COMPLETIONS, {"guided_choice": ["a"]}).status_code == 200  # stop
    with httpx.stream("POST", live.url + CHAT, timeout=60, json={
            "messages": HELLO, "max_tokens": 900, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first event, then the client leaves: abort
    error_of(post(live, CHAT, {"foo": 1}))
    error_of(post(live, CHAT, {"model": "nope"}), 404)
    error_of(httpx.get(f"{live.url}/v1/nothing", timeout=30), 404)
    expected = {
        ("request_success", 'finished_reason="length"'): 2,
        ("request_success", 'finished_reason="stop"'): 1,
        ("request_success", 'finished_reason="abort"'): 1,
        ("http_errors", 'code="unknown_parameter",status="400"'): 1,
        ("http_errors", 'code="model_not_found",status="404"'): 1,
        ("http_errors", 'code="not_found",status="404"'): 1,
    }

    def counted() -> bool:
        after = outcomes(live)
        return all(after.get(key, 0) - before.get(key, 0) == n for key, n in expected.items())

    assert wait_until(counted, 30), [(k, v) for k, v in outcomes(live).items() if v]
    assert wait_until(lambda: live.engine.requests == {}, 30)


@pytest.mark.parametrize("top_k", [2**31, 378005095840640143458304])
def test_a_top_k_past_any_tensor_is_a_400_and_the_engine_keeps_serving(live, top_k):
    """Found by schemathesis: a 2**78 top_k reached the sampler, whose tensor of
    top_k values overflowed, and the engine thread died (503 ever after)."""
    assert error_of(post(live, "/v1/completions", {"top_k": top_k}))["param"] == "top_k"
    assert post(live, "/v1/completions", {"top_k": 2**31 - 1}).status_code == 200
    assert post(live, "/v1/completions", {}).status_code == 200
