"""Structured outputs over HTTP on the real SmolLM2: response_format and structured_outputs.

The official `openai` SDK, unchanged: `chat.completions.create` with a JSON
schema, and `chat.completions.parse` with a pydantic model. vLLM's
`structured_outputs` field travels in `extra_body`. Invalid constraints are
400s naming the field, before any engine work.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from pydantic import BaseModel

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 30},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "languages": {"type": "array", "maxItems": 3,
                                 "items": {"enum": ["en", "fr", "de"]}}},
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a fictional person as JSON."}]


class City(BaseModel):
    name: str
    population: int
    coastal: bool


@pytest.fixture(scope="module")
def sdk(smollm2_server):
    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", timeout=120)
    model = client.models.list().data[0].id
    return client, model


def test_json_schema_response_format(sdk):
    client, model = sdk
    response = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=120, temperature=0.7, seed=3,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_the_sdks_parse_helper_with_a_pydantic_model(sdk):
    client, model = sdk
    completions = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    response = completions(
        model=model, max_tokens=100, temperature=0,
        messages=[{"role": "user", "content": "Tell me about a city by the sea."}],
        response_format=City)
    city = response.choices[0].message.parsed
    assert isinstance(city, City)


def test_json_object_streamed(sdk):
    client, model = sdk
    stream = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=150, temperature=0, stream=True,
        response_format={"type": "json_object"})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert isinstance(json.loads(text), dict)


def test_vllms_structured_outputs_field_on_both_endpoints(sdk):
    client, model = sdk
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert chat.choices[0].message.content in ("yes", "no")
    completion = client.completions.create(
        model=model, prompt="The year the war ended:", max_tokens=10,
        extra_body={"structured_outputs": {"regex": "(19|20)[0-9]{2}"}})
    assert re.fullmatch(r"(19|20)[0-9]{2}", completion.choices[0].text)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
])
def test_an_invalid_constraint_is_a_400_naming_the_field(smollm2_server, extra, param):
    body = {"messages": ASK, "max_tokens": 4, **extra}
    response = httpx.post(f"{smollm2_server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert smollm2_server.engine.requests == {}
