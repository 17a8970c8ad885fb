"""Responses input items into chat messages (service/responses/input.py), without
a server: where a reasoning item's thought goes across turns."""

from __future__ import annotations

import msgspec

from service.responses.input import to_messages
from service.responses.protocol import ResponsesRequest


def messages(items: list[dict]):
    return to_messages(msgspec.convert({"input": items}, ResponsesRequest))[0]


def thought(text: str) -> dict:
    return {"type": "reasoning", "summary": [{"type": "summary_text", "text": text}]}


def test_a_thought_goes_to_the_next_assistant_turn_only():
    got = messages([{"role": "user", "content": "one"}, thought("first thought"),
                    {"role": "assistant", "content": "answer one"},
                    {"role": "user", "content": "two"},
                    {"role": "assistant", "content": "answer two"}])
    assert [(m.role, m.reasoning_content) for m in got] == [
        ("user", None), ("assistant", "first thought"), ("user", None), ("assistant", None)]


def test_a_thought_before_a_call_stays_with_that_call_turn():
    got = messages([{"role": "user", "content": "weather?"}, thought("call the tool"),
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                    {"role": "assistant", "content": "It is sunny."}])
    assert [(m.role, m.reasoning_content) for m in got] == [
        ("user", None), ("assistant", "call the tool"), ("tool", None), ("assistant", None)]
