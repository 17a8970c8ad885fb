"""Constraints that say what they mean (issue 38): compiles bounded in time and
size, choices that keep their characters, xgrammar's cache bug compiled around
and never shown, and constraints that accept nothing refused.

Over HTTP to a real server on the tiny random Llama (SmolLM2's tokenizer, so
xgrammar compiles against the real vocabulary); the model is random, but the
constraint holds its output whatever it draws.
"""

from __future__ import annotations

import json
import logging
import re
import time

import httpx
import pytest

from live_server import run_server, tiny_config

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello there"}]
SCHEMA_PARAM = "response_format.json_schema.schema"
# What a refusal must never show: xgrammar's assertions and source locations.
INTERNAL = re.compile(r"Check failed|per_rule_fsm_hashes|has_value|\.cc:\d+")


@pytest.fixture(scope="module")
def live(tiny_llama_path):
    with run_server(tiny_config(tiny_llama_path)) as server:
        yield server


def json_schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "s", "schema": schema}}}


def post(live, body: dict, path: str = CHAT) -> httpx.Response:
    if path == CHAT:
        body = {"messages": HELLO, **body}
    return httpx.post(live.url + path, json={"max_tokens": 8, **body}, timeout=120)


def refused(live, body: dict, param: str, path: str = CHAT) -> str:
    response = post(live, body, path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert not INTERNAL.search(error["message"]), error
    return error["message"]


# -- row 1: compiles bounded in time and size --------------------------------------------
HOSTILE = {"type": "object", "properties": {
    name: {"type": "string", "pattern": "^[a-z]{1,4400}$"} for name in "abc"}}


@pytest.mark.parametrize("body, param, says", [
    (json_schema(HOSTILE), SCHEMA_PARAM, "expands to 4402 characters"),
    ({"structured_outputs": {"json": HOSTILE}}, "structured_outputs", "expands to"),
    # Nested ranged repetitions: 17 s of compiling each before the bound.
    (json_schema({"type": "string", "pattern": "^(.{1,10}){1,10}$"}), SCHEMA_PARAM,
     "multiply to 100"),
    (json_schema({"type": "string", "pattern": "^(([a-z]{1,5}){1,5}){1,5}$"}),
     SCHEMA_PARAM, "multiply to 125"),
    # Ten distinct maxLength bounds: ~1.4 s of compiling each.
    (json_schema({"type": "object", "properties": {
        f"p{i}": {"type": "string", "maxLength": 100 + i} for i in range(10)}}),
     SCHEMA_PARAM, "budget"),
    ({"structured_outputs": {"grammar": " ".join(
        ["root ::="] + [f'[^"]{{0,{150 + i}}}' for i in range(7)])}},
     "structured_outputs", "budget"),
])
def test_a_constraint_too_costly_to_compile_is_refused_at_once(live, body, param, says):
    started = time.monotonic()
    assert says in refused(live, body, param)
    assert time.monotonic() - started < 5
    assert live.engine.requests == {}


def test_common_bounded_schemas_still_compile(live):
    schema = {"type": "object", "properties": {
        "ip": {"type": "string", "pattern": r"^(\d{1,3}\.){3}\d{1,3}$"},
        "name": {"type": "string", "maxLength": 50},
        "bio": {"type": "string", "maxLength": 500},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 1000}},
        "required": ["ip"]}
    response = post(live, json_schema(schema))
    assert response.status_code == 200, response.text


# -- row 2: choices keep their characters ------------------------------------------------
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_choices_outside_the_basic_plane_come_back_as_written(live, path):
    choices = ["\N{GRINNING FACE} yes", "\N{GRINNING FACE} no", "caf\u00e9 \"q\"\n"]
    body = {"structured_outputs": {"choice": choices}, "max_tokens": 40, "temperature": 0}
    if path == COMPLETIONS:
        body["prompt"] = "Answer:"
    response = post(live, body, path)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    text = choice["message"]["content"] if path == CHAT else choice["text"]
    assert choice["finish_reason"] == "stop"
    assert text in choices, text


# -- row 3: xgrammar's cache bug compiled around; its words never shown ------------------
def test_a_pattern_repeated_150_times_or_more_compiles(live):
    schema = {"type": "string", "pattern": "^[0-9]{1,160}$"}
    response = post(live, {**json_schema(schema), "max_tokens": 200})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "stop"
    assert re.fullmatch(r"[0-9]{1,160}", json.loads(choice["message"]["content"]))


@pytest.mark.parametrize("stage", ["parse", "compile"])
def test_an_internal_xgrammar_failure_is_a_plain_400_and_logged(live, monkeypatch, caplog,
                                                                  stage):
    import xgrammar

    secret = "[12:00:00] /project/cpp/grammar_functor.cc:3567: Check failed: (secret) is false"

    def fail(*args, **kwargs):
        raise RuntimeError(secret)

    class Failing:
        compile_grammar = staticmethod(fail)

    if stage == "parse":
        monkeypatch.setattr(xgrammar.Grammar, "from_regex", fail)
    else:
        compiler = live.state.engine.engine.structured_outputs
        monkeypatch.setattr(compiler, "compiler", lambda cached=True: Failing())
    caplog.set_level(logging.ERROR)
    message = refused(live, {"structured_outputs": {"regex": f"[0-9]{{3}}-{stage}"}},
                      "structured_outputs")
    assert "could not be compiled" in message
    assert any("(secret)" in r.getMessage() + (r.exc_text or "") for r in caplog.records)


# -- row 5: constraints that accept nothing, references that go nowhere -------------------
@pytest.mark.parametrize("body, param, says", [
    ({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs", "no output"),
    ({"structured_outputs": {"grammar": 'root ::= "a" root'}}, "structured_outputs",
     "no output"),
    (json_schema({"$ref": "#"}), SCHEMA_PARAM, "no output"),
    (json_schema({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                  "$ref": "#/$defs/a"}), SCHEMA_PARAM, "no output"),
    (json_schema({"type": "object", "properties": {"child": {"$ref": "#"}},
                  "required": ["child"]}), SCHEMA_PARAM, "no output"),
    (json_schema({"$ref": "https://example.com/schema.json"}), SCHEMA_PARAM, "never fetched"),
    (json_schema({"type": "object", "properties": {"a": {"$ref": "file:///etc/passwd"}}}),
     SCHEMA_PARAM, "never fetched"),
    (json_schema({"$ref": "#/$defs/missing"}), SCHEMA_PARAM, "does not resolve"),
])
def test_a_constraint_that_accepts_nothing_is_refused(live, body, param, says):
    assert says in refused(live, body, param)


def test_a_recursive_schema_that_can_end_is_served(live):
    tree = {"type": "object", "properties": {"leaf": {"type": "integer"},
                                             "child": {"$ref": "#"}}, "required": ["leaf"]}
    response = post(live, {**json_schema(tree), "max_tokens": 4})
    assert response.status_code == 200, response.text


def test_the_server_is_idle_after_the_battery(live):
    assert httpx.get(f"{live.url}/health", timeout=10).status_code == 200
    assert live.engine.requests == {}
