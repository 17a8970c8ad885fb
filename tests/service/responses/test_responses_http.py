"""POST /v1/responses through the official `openai` SDK, unchanged: `responses.create`,
`responses.stream` and `responses.parse` on the real SmolLM2, and a thinking model's
reasoning items on the tiny thinker (tests/tiny_models.py).

Expectations come from elsewhere than the route: token counts from /tokenize
(the chat template as chat serving renders it), text from the chat route for
the same messages, the thought and answer from HF's greedy output.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from pydantic import BaseModel

from live_server import run_server, tiny_config, wait_until
from tiny_models import THINK_TOKENS, make_tiny_thinker, teach_to_end_thought

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.usefixtures("single_thread")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": WEATHER, "strict": True}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."
QUESTION = "What is the capital of France?"
LONG_TEXT = (
    "Paged attention splits the key/value cache of every request into fixed-size blocks. "
    "A block table maps each logical block of a sequence to a physical block in a shared "
    "pool, so memory is handed out on demand and returned the moment a request finishes. ")


class City(BaseModel):
    name: str
    population: int


@pytest.fixture(scope="module")
def sdk(smollm2_server):
    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    return client, client.models.list().data[0].id


def chat_messages(instructions: str, question: str) -> list[dict]:
    return [{"role": "system", "content": instructions}, {"role": "user", "content": question}]


def test_plain_text_matches_chat_and_counts_as_tokenize(sdk, smollm2_server):
    client, model = sdk
    response = client.responses.create(model=model, instructions=INSTRUCTIONS, input=QUESTION,
                                       max_output_tokens=40, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.output_text
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == "completed"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    # The settings come back, as OpenAI echoes them; nothing was stored.
    assert (response.instructions, response.max_output_tokens) == (INSTRUCTIONS, 40)
    assert response.temperature == 0 and response.tools == [] and response.tool_choice == "auto"
    assert response.text.format.type == "text" and response.model_extra["store"] is False

    messages = chat_messages(INSTRUCTIONS, QUESTION)
    count = httpx.post(f"{smollm2_server.url}/tokenize", json={"messages": messages},
                       timeout=60).json()["count"]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=40,
                                          temperature=0)
    usage = response.usage
    assert usage.input_tokens == count == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_a_stream_has_the_sdk_events_in_order(sdk):
    client, model = sdk
    kwargs = dict(model=model, instructions=INSTRUCTIONS, input=QUESTION,
                  max_output_tokens=40, temperature=0)
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed"
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *[d.type for d in deltas],
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(delta.delta for delta in deltas)
    assert len(deltas) > 1 and text == events[-4].text == final.output_text == whole.output_text
    assert final.id == events[0].response.id and final.status == "completed"
    assert final.output[0].id == events[2].item.id == deltas[0].item_id
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_max_output_tokens_makes_it_incomplete(sdk):
    client, model = sdk
    kwargs = dict(model=model, input="Write a long story about a dragon.", max_output_tokens=3,
                  temperature=0)
    response = client.responses.create(**kwargs)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 3
    events = list(client.responses.create(stream=True, **kwargs))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == response.output_text


def test_json_schema_text_format(sdk):
    client, model = sdk
    response = client.responses.create(
        model=model, input="Describe a fictional person as JSON.", max_output_tokens=60,
        temperature=0.7, text={"format": {"type": "json_schema", "name": "person",
                                          "schema": PERSON, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text.format.name == "person"
    parsed = client.responses.parse(model=model, input="Describe a city as JSON.",
                                    text_format=City, max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, City)


def test_a_function_tool_round_trip(sdk):
    client, model = sdk
    question = [{"role": "user", "content": "What's the weather like in Paris?"}]
    response = client.responses.create(model=model, input=question, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_output_tokens=60, temperature=0)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert response.tool_choice == "required" and response.tools[0].name == "get_weather"

    # The next turn: the call as the SDK returned it, then its output.
    turn = [*question, call, {"type": "function_call_output", "call_id": call.call_id,
                              "output": "18 degrees celsius and sunny"}]
    answer = client.responses.create(model=model, input=turn, tools=TOOLS, tool_choice="none",
                                     max_output_tokens=30, temperature=0)
    assert answer.output[0].type == "message" and answer.output_text

    named = {"type": "function", "name": "get_weather"}
    with client.responses.stream(model=model, input=question, tools=TOOLS, tool_choice=named,
                                 max_output_tokens=60, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert events[2].item.type == "function_call" and events[2].item.name == "get_weather"
    (streamed,) = final.output
    assert "".join(pieces) == streamed.arguments == events[-3].arguments
    jsonschema.validate(json.loads(streamed.arguments), WEATHER)


def test_cached_tokens_on_a_repeated_prompt(sdk, smollm2_server):
    client, model = sdk
    block_size = smollm2_server.engine.config.block_size
    instructions = f"[{uuid.uuid4().hex}] Summarise what the user says. " + LONG_TEXT
    first = client.responses.create(model=model, instructions=instructions, input="Go.",
                                    max_output_tokens=2, temperature=0)
    second = client.responses.create(model=model, instructions=instructions, input="Go.",
                                     max_output_tokens=2, temperature=0)
    assert first.usage.input_tokens == second.usage.input_tokens > 3 * block_size
    assert first.usage.input_tokens_details.cached_tokens == 0
    cached = second.usage.input_tokens_details.cached_tokens
    assert ((second.usage.input_tokens - 1) // block_size) * block_size <= cached > 0


def test_a_client_that_leaves_frees_its_request(smollm2_server):
    body = {"input": "Write a long story about a dragon.", "max_output_tokens": 1000,
            "stream": True}
    with httpx.stream("POST", f"{smollm2_server.url}/v1/responses", json=body,
                      timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        while "response.output_text.delta" not in next(lines):
            pass
    engine = smollm2_server.state.engine
    assert wait_until(lambda: engine.stats.counters["num_requests_running"] == 0, timeout=20)


def test_a_failure_mid_stream_is_an_error_event_then_response_failed(tiny_llama_path,
                                                                     monkeypatch):
    with run_server(tiny_config(tiny_llama_path, engine={"max_model_len": 1024})) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        stream = client.responses.create(model="tiny", input="Tell me a story.",
                                         max_output_tokens=900, stream=True)
        events = [next(stream)]  # it leaves with the first token: the engine runs it

        def boom(*args, **kwargs):
            raise RuntimeError("injected fault in the model runner")

        monkeypatch.setattr(live.engine.runner, "execute", boom)
        events += list(stream)
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[-2].code == "engine_dead" and "injected fault" in events[-2].message
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "engine_dead"
    assert failed.id == events[0].response.id


@pytest.mark.parametrize("extra, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"prompt_cache_key": "k"}, "prompt_cache_key"),
    ({"temperature": 3}, "temperature"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": TOOLS}, "tool_choice"),  # "auto": SmolLM2's template has no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [{**TOOLS[0], "parameters": {"type": "array"}}], "tool_choice": "required"},
     "tools[0].parameters"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     "input[0].content[1].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "call_9", "output": "x"}]},
     "input[1].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                 "arguments": "[" * 50_000 + "]" * 50_000}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c", "name": "g", "arguments": "{}"}]},
     "input[1].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "1"},
                {"type": "function_call_output", "call_id": "c", "output": "2"}]},
     "input[2].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                 "arguments": '{"a": ' * 30_000 + "1" + "}" * 30_000}]}, "input[0].arguments"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}}}},
     "text.format.schema"),
    ({"text": {"format": {"type": "json_object"}}, "tools": TOOLS, "tool_choice": "required"},
     "text.format"),
])
def test_what_is_not_served_is_a_400_naming_it(smollm2_server, extra, param):
    body = {"input": "Hello", "max_output_tokens": 4, **extra}
    response = httpx.post(f"{smollm2_server.url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_an_input_too_long_for_the_context_is_refused_in_the_responses_words(smollm2_server):
    response = httpx.post(f"{smollm2_server.url}/v1/responses", timeout=60,
                          json={"input": "a " * 200_000, "max_output_tokens": 4})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input", error
    assert "characters of input are at least" in error["message"], error
    assert "messages" not in error["message"], error


def test_the_sdk_raises_the_400_with_its_param(sdk):
    client, model = sdk
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model, input="Hi", store=True)
    assert refused.value.body["param"] == "store"


# -- reasoning items ---------------------------------------------------------------------
THINK_MAX_TOKENS = 24
THINK_QUESTION = "What is two plus two?"


@pytest.fixture(scope="module")
def thinker(tmp_path_factory, smollm2_path):
    """The tiny thinker served with --reasoning-parser qwen3 (see test_reasoning_http.py):
    HF's greedy output thinks a few tokens, writes </think> and answers."""
    from transformers import AutoTokenizer

    folder = make_tiny_thinker(tmp_path_factory.mktemp("thinker"), smollm2_path)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": THINK_QUESTION}],
                                           tokenize=False, add_generation_prompt=True)
    taught = teach_to_end_thought(folder, tokenizer.encode(prompt, add_special_tokens=False),
                                  THINK_MAX_TOKENS)
    thought, answer = tokenizer.decode(taught).split(THINK_TOKENS[1])
    end = taught.index(tokenizer.convert_tokens_to_ids(THINK_TOKENS[1]))
    with run_server(tiny_config(folder, reasoning_parser="qwen3")) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        yield client, thought, answer, end + 1


def test_a_thought_is_a_reasoning_item(thinker):
    client, thought, answer, thought_tokens = thinker
    kwargs = dict(model="tiny", input=THINK_QUESTION, max_output_tokens=THINK_MAX_TOKENS,
                  temperature=0)
    response = client.responses.create(**kwargs)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text == thought and reasoning.status == "completed"
    assert message.type == "message" and response.output_text == answer
    assert response.status == "incomplete"  # HF's greedy answer runs to max_output_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == thought_tokens

    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[2].item.type == "reasoning"
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (streamed, said) == (thought, answer)
    last_thought = max(i for i, kind in enumerate(kinds) if kind.startswith("response.reason"))
    assert kinds.index("response.output_text.delta") > last_thought
    final = events[-1].response
    assert final.output[0].content[0].text == thought and final.output_text == answer
