"""Tool calls over HTTP: the real SmolLM2 through the official `openai` SDK, unchanged.

SmolLM2's chat template has no tools, so tool_choice "auto" is refused and
"required" / named functions are held to the tools' schemas by a grammar;
every call that comes back must validate. tool_choice "auto" is exercised on
the tiny Llama given a Hermes-style and a Mistral-style template (its random
output calls no tool; the parsing itself is tests/service/tool_calls/test_tool_parsers.py).
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from live_server import run_server, tiny_config
from tiny_models import HERMES_CHAT_TEMPLATE, MISTRAL_CHAT_TEMPLATE

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
        "required": ["timezone"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {
    "query": {"type": "string", "maxLength": 60},
    "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
    "required": ["query", "max_results"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "search": SEARCH}
TOOLS = [{"type": "function", "function": {"name": name, "description": text, "parameters": schema}}
         for (name, schema), text in zip(SCHEMAS.items(), [
             "The current weather in a city", "The current time in a timezone", "Search the web"])]
QUESTIONS = [
    "What's the weather like in Paris?", "What time is it in Tokyo?",
    "Find recent news about electric cars.", "Is it raining in London right now?",
    "Who won the 2018 football world cup?", "What's the time in New York?",
    "Look up a recipe for pancakes.", "How cold is it in Oslo today?",
]


def ask(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def sdk(smollm2_server):
    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", timeout=120)
    return client, client.models.list().data[0].id


def assert_valid(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def test_required_returns_calls_whose_arguments_validate(sdk):
    client, model = sdk

    def required(i: int, question: str, parallel: bool):
        return client.chat.completions.create(
            model=model, messages=ask(question), tools=TOOLS, tool_choice="required",
            parallel_tool_calls=parallel, max_tokens=150, temperature=0.7, seed=i).choices[0]

    cases = [(i, q, parallel) for i, q in enumerate(QUESTIONS) for parallel in (False, True)]
    with ThreadPoolExecutor(len(cases)) as pool:  # one batch in the engine
        choices = list(pool.map(lambda case: required(*case), cases))
    for (_, _, parallel), choice in zip(cases, choices):
        assert choice.message.content is None
        calls = choice.message.tool_calls
        if choice.finish_reason == "length":  # cut short: the last call may be partial
            assert parallel
            calls = calls[:-1]
        else:
            assert choice.finish_reason == "tool_calls"
            assert len(calls) == 1 or (parallel and len(calls) > 1)
        for call in calls:
            assert_valid(call)


def test_a_named_function_finishes_with_stop(sdk):
    client, model = sdk
    response = client.chat.completions.create(
        model=model, messages=ask("Find recent news about electric cars."), tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "search"}}, max_tokens=100)
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "search"
    assert_valid(call)


def test_streamed_calls_are_the_unstreamed_calls(sdk):
    client, model = sdk
    request = dict(model=model, messages=ask("What's the weather like in Paris?"), tools=TOOLS,
                   tool_choice="required", max_tokens=300, temperature=0)
    whole = client.chat.completions.create(**request).choices[0]
    chunks = list(client.chat.completions.create(**request, stream=True))
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    # The first piece of a call carries its id, type and name; the rest only arguments.
    opened = [p for p in pieces if p.id is not None]
    assert [p.function.name for p in opened] == [
        c.function.name for c in whole.message.tool_calls]
    assert all(p.type == "function" for p in opened)
    assert all(p.function.name is None for p in pieces if p.id is None)
    assert len(pieces) > 3 * len(opened)  # the arguments arrive piece by piece
    arguments = ["" for _ in opened]
    for piece in pieces:
        arguments[piece.index] += piece.function.arguments or ""
    assert arguments == [c.function.arguments for c in whole.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    # The SDK's own accumulator reads the same stream into the same calls.
    with client.chat.completions.stream(**request) as stream:
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_n_choices_each_call(sdk):
    client, model = sdk
    response = client.chat.completions.create(
        model=model, messages=ask("How cold is it in Oslo today?"), tools=TOOLS, n=3, seed=5,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0, max_tokens=100)
    assert len(response.choices) == 3
    for choice in response.choices:
        assert_valid(choice.message.tool_calls[0])


def test_a_conversation_with_tool_results_is_answered(sdk):
    client, model = sdk
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    messages = [*ask("What's the weather like in Paris?"),
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    response = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=30)
    choice = response.choices[0]
    assert choice.message.tool_calls is None and choice.message.content


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                      json={"messages": ask("Hi"), "max_tokens": 5, **body})


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS}, "tool_choice"),  # auto: SmolLM2 has no tool-call format
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "two words"}}]},
     "tools[0].function.name"),
])
def test_refusals_name_the_field(smollm2_server, body, param):
    response = post(smollm2_server, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


DEEP = "[" * 50_000 + "]" * 50_000  # Python's decoder recursed past its limit: a 500


def called(arguments: str) -> list[dict]:
    return [*ask("Hi"), {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "done"}]


@pytest.mark.parametrize("arguments", [DEEP, '{"a": ' * 30_000 + "1" + "}" * 30_000,
                                       "[" * 65 + "]" * 65])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_arguments_nested_too_deeply_are_a_400_naming_them(smollm2_server, route, arguments):
    extra = {"max_tokens": 2} if route.startswith("/v1") else {}
    response = httpx.post(f"{smollm2_server.url}{route}", timeout=60,
                          json={"messages": called(arguments), **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[1].tool_calls[0].function.arguments", error
    assert "nested more than 64 levels" in error["message"]


def test_arguments_64_levels_deep_are_served(smollm2_server):
    response = httpx.post(f"{smollm2_server.url}/tokenize", timeout=60,
                          json={"messages": called("[" * 64 + "]" * 64)})
    assert response.status_code == 200, response.text


TEMPLATES = {"hermes": HERMES_CHAT_TEMPLATE, "mistral": MISTRAL_CHAT_TEMPLATE}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def template_server(request, tiny_llama_path, tmp_path_factory):
    """The tiny Llama with a tool-calling template; the format "auto" should read from it."""
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}") / "model"
    shutil.copytree(tiny_llama_path, folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TEMPLATES[request.param]
    config_file.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    with run_server(tiny_config(folder, {"max_model_len": 512})) as live:
        yield live, folder, request.param


def test_auto_on_a_template_with_tools(template_server):
    from transformers import AutoTokenizer

    server, folder, format_name = template_server
    assert server.state.tool_parser == format_name  # read from the template
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    rendered = tokenizer.apply_chat_template(ask("Hi"), tools=TOOLS, add_generation_prompt=True,
                                             tokenize=False)
    # Mistral's marker is a special token, so "auto" keeps them in the text: both alike here.
    keep = {"skip_special_tokens": False, "max_tokens": 8, "temperature": 0}
    auto = post(server, {"tools": TOOLS, **keep}).json()
    none = post(server, {"tools": TOOLS, "tool_choice": "none", **keep}).json()
    # The tools reached the template: the prompt is the template's rendering with them.
    expected = len(tokenizer.encode(rendered, add_special_tokens=False))
    assert auto["usage"]["prompt_tokens"] == expected == none["usage"]["prompt_tokens"]
    # Text without a <tool_call> is content, untouched by the parser.
    assert auto["choices"][0]["message"]["content"] == none["choices"][0]["message"]["content"]
    assert "tool_calls" not in auto["choices"][0]["message"]
    assert auto["choices"][0]["finish_reason"] == "length"


def test_required_calls_go_back_through_the_template(template_server):
    """Their ids take the format's shape: Mistral's templates refuse any but 9 characters."""
    server, _, format_name = template_server
    ping = [{"type": "function", "function": {"name": "ping"}}]
    response = post(server, {"tools": ping, "tool_choice": "required", "max_tokens": 40,
                             "parallel_tool_calls": False, "temperature": 0})
    [call] = response.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "ping", "arguments": "{}"}
    if format_name == "mistral":
        assert len(call["id"]) == 9 and call["id"].isalnum()
    else:
        assert call["id"].startswith("call_")
    history = [*ask("Ping?"), {"role": "assistant", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": "pong"}]
    answer = post(server, {"messages": history, "tools": ping, "tool_choice": "none"})
    assert answer.status_code == 200, answer.text
    # Another server's ids (OpenAI's "call_..."), which Mistral's template would
    # refuse ("length 9"), are mapped into its form (tool_parsers.mistral_history_id).
    history[1]["tool_calls"][0]["id"] = history[2]["tool_call_id"] = "call_" + "0" * 24
    foreign = post(server, {"messages": history, "tools": ping, "tool_choice": "none"})
    assert foreign.status_code == 200, foreign.text
