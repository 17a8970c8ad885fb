"""Reasoning input items across turns, over HTTP (issue 57).

The rule (service/responses/input.py): a `reasoning` item is the thought of
the next assistant turn, and of that turn only (a thought before a
function_call stays with the call's turn; one with no assistant turn after
it is dropped). The server here is a tiny random Llama whose chat template
shows an assistant message's `reasoning_content`, so where a thought lands
changes the prompt. What the model saw is judged from outside the route:
the input token count equals /tokenize's for the chat messages the rule
gives, and the greedy answer equals chat's for those messages.
"""

from __future__ import annotations

import pytest

from live_server import run_server, tiny_config
from tiny_models import make_tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")

# Writes an assistant message's thought before its content, and its calls after.
SHOWS_THOUGHTS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}{% for c in m.tool_calls or [] %}{{ c.function | tojson }}{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def live(tmp_path_factory, smollm2_path):
    from transformers import AutoTokenizer

    folder = make_tiny_model(tmp_path_factory.mktemp("shows-thoughts"), smollm2_path)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.chat_template = SHOWS_THOUGHTS
    tokenizer.save_pretrained(folder)
    with run_server(tiny_config(folder)) as server:
        yield server


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str | None, thought: str | None = None, **extra) -> dict:
    message = {"role": "assistant", "content": text, **extra}
    return {**message, "reasoning_content": thought} if thought else message


def thought(text: str) -> dict:
    return {"type": "reasoning", "summary": [{"type": "summary_text", "text": text}]}


CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
CONVERSATIONS = {
    # items, and the chat messages the rule makes of them
    "next-turn-only": (
        [user("one"), thought("first thought"), assistant("answer one"), user("two"),
         assistant("answer two"), user("three")],
        [user("one"), assistant("answer one", "first thought"), user("two"),
         assistant("answer two"), user("three")]),
    "each-turn-its-own": (
        [user("one"), thought("first"), assistant("answer one"), user("two"),
         thought("second"), assistant("answer two"), user("three")],
        [user("one"), assistant("answer one", "first"), user("two"),
         assistant("answer two", "second"), user("three")]),
    "with-the-call": (
        [user("weather?"), thought("call the tool"),
         {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"},
         {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
         assistant("It is sunny."), user("and tomorrow?")],
        [user("weather?"), assistant(None, "call the tool", tool_calls=[CALL]),
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
         assistant("It is sunny."), user("and tomorrow?")]),
    "none-after-it": (
        [user("one"), assistant("answer one"), user("two"), thought("unanswered")],
        [user("one"), assistant("answer one"), user("two")]),
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_a_thought_reaches_the_model_in_its_own_turn_only(live, name):
    items, messages = CONVERSATIONS[name]
    with live.client() as http:
        response = http.post("/v1/responses", json={
            "input": items, "max_output_tokens": 4, "temperature": 0})
        counted = http.post("/tokenize", json={"messages": messages})
        chat = http.post("/v1/chat/completions", json={
            "messages": messages, "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    assert counted.status_code == 200 and chat.status_code == 200, (counted.text, chat.text)
    answer = response.json()
    assert answer["usage"]["input_tokens"] == counted.json()["count"], name
    said = "".join(part["text"] for item in answer["output"] if item["type"] == "message"
                   for part in item["content"])
    assert said == chat.json()["choices"][0]["message"]["content"], name
