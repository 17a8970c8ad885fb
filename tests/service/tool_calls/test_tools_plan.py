"""tools + tool_choice -> the plan: which constraint, which parser, which 400; and the prompt.

Pure functions on decoded request bodies; the grammars themselves are
compiled against the real tokenizer in test_tool_calls_http.py.
"""

from __future__ import annotations

import json

import msgspec
import pytest

from engine.frontend.chat_template import render_chat_text, renders_tools
from service.errors import APIError
from service.protocol.requests import ChatCompletionRequest
from service.tool_calls.plan import plan_tools, template_messages, template_tools
from tiny_models import HERMES_CHAT_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]

def request(**fields) -> ChatCompletionRequest:
    return msgspec.convert({"messages": ASK, **fields}, ChatCompletionRequest)


def refused(param: str, **fields) -> str:
    with pytest.raises(APIError) as caught:
        plan_tools(request(**fields), parser=None)
    assert caught.value.status == 400 and caught.value.param == param, caught.value
    return caught.value.message


def test_no_tools_no_plan():
    assert plan_tools(request(), None) is None
    assert plan_tools(request(tools=[], tool_choice="none"), None) is None


def test_required_holds_the_output_to_a_list_of_calls():
    plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required"), None)
    schema = json.loads(plan.constraint.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    # A function without parameters takes an empty object.
    assert schema["items"]["anyOf"][1]["properties"]["arguments"]["properties"] == {}
    assert list(schema["items"]["anyOf"][0]["properties"]) == ["name", "arguments"]
    one = plan_tools(request(tools=[WEATHER], tool_choice="required",
                             parallel_tool_calls=False), None)
    assert json.loads(one.constraint.json)["maxItems"] == 1


def test_a_named_function_holds_the_output_to_its_parameters():
    plan = plan_tools(request(tools=[TIME, WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), None)
    assert (plan.choice, plan.function) == ("function", "get_weather")
    assert json.loads(plan.constraint.json) == WEATHER["function"]["parameters"]
    assert plan.constraint_param == "tools[1].function.parameters"
    assert plan.finish_reason("stop", 1) == "stop"


def test_finish_reason_is_tool_calls_only_when_the_model_stopped_after_calling():
    plan = plan_tools(request(tools=[WEATHER], tool_choice="required"), None)
    assert plan.finish_reason("stop", 2) == "tool_calls"
    assert plan.finish_reason("length", 2) == "length"
    auto = plan_tools(request(tools=[WEATHER]), "hermes")
    assert (auto.choice, auto.parser) == ("auto", "hermes")
    assert auto.finish_reason("stop", 0) == "stop"


def test_refusals_name_the_field():
    assert "needs tools" in refused("tool_choice", tool_choice="required")
    message = refused("tool_choice", tools=[WEATHER])  # auto, and no format to read
    assert '"required"' in message
    refused("tool_choice", tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}})
    refused("tools[1].function.name", tools=[WEATHER, WEATHER])
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
    refused("tools[0].function.parameters", tools=[bad], tool_choice="required")


def test_malformed_tools_fail_decoding():
    for tools in ([{"type": "function", "function": {"name": "has space"}}],
                  [{"type": "retrieval"}], [{"function": {"name": "f"}}]):
        with pytest.raises(msgspec.ValidationError):
            request(tools=tools)
    with pytest.raises(msgspec.ValidationError):
        request(tools=[WEATHER], tool_choice="sometimes")


HISTORY = [
    {"role": "system", "content": "Be brief."},
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


def test_a_template_without_tools_gets_them_in_the_system_turn():
    plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required"), None)
    messages = template_messages(request(messages=HISTORY).messages, plan, renders_tools=False)
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n") and "get_weather: Weather in a city" in system
    assert json.dumps(WEATHER["function"]["parameters"]) in system
    # The earlier call, written in the shape "required" generates.
    assert json.loads(messages[2]["content"]) == [
        {"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert messages[3] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}
    assert template_tools(plan, renders_tools=False) is None
    # A named function: only that one is described; "none": nothing is added.
    named = plan_tools(request(tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_time"}}), None)
    note = template_messages(request().messages, named, False)[0]["content"]
    assert "get_time" in note and "get_weather" not in note
    none = plan_tools(request(tools=[WEATHER], tool_choice="none"), None)
    assert template_messages(request().messages, none, False) == [ASK[0]]


def test_a_template_with_tools_renders_them_and_the_calls(smollm2_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path))
    assert not renders_tools(tokenizer)  # SmolLM2's template has no tools
    tokenizer.chat_template = HERMES_CHAT_TEMPLATE
    assert renders_tools(tokenizer)
    plan = plan_tools(request(tools=[WEATHER]), "hermes")
    messages = template_messages(request(messages=HISTORY).messages, plan, renders_tools=True)
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    text = render_chat_text(tokenizer, messages, tools=template_tools(plan, True))
    assert text.startswith('<|im_start|>system\n<tools>{"type": "function"')
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' in text


def test_arguments_that_are_not_json_are_refused_by_position():
    history = [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(APIError) as caught:
        template_messages(request(messages=history).messages, None, renders_tools=True)
    assert caught.value.param == "messages[1].tool_calls[0].function.arguments"


def test_the_depth_of_arguments_is_counted_without_recursing():
    from service.tool_calls.base import depth, request_arguments

    assert [depth(v) for v in (1, "x", None, [], {}, [[]], {"a": [{"b": 1}]})] == [0, 0, 0, 1, 1, 2, 3]
    nested = []
    for _ in range(100_000):  # deeper than any recursion limit
        nested = [nested]
    assert depth(nested) == 100_001
    assert depth(request_arguments("[" * 64 + "]" * 64, "p")) == 64
    assert request_arguments("null", "p") is None
    for refused in ("[" * 65 + "]" * 65, "[" * 50_000 + "]" * 50_000, "{oops"):
        with pytest.raises(APIError) as caught:
            request_arguments(refused, "p")
        assert caught.value.param == "p"
