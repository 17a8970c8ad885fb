"""A 400's `param` is the field the engine's ValidationError carries, never a
word read out of its message (engine/errors.py, service/errors.py).

Over HTTP to a real server on the tiny random Llama (max_model_len 256).
"""

from __future__ import annotations

import httpx
import pytest

from engine.errors import ValidationError
from engine.sampling_params import SamplingParams
from live_server import run_server, tiny_config

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello there"}]
VOCAB = 49152  # the tiny model's vocabulary (SmolLM2's tokenizer)


@pytest.fixture(scope="module")
def live(tiny_llama_path):
    with run_server(tiny_config(tiny_llama_path)) as server:
        yield server


def error_of(live, path: str, body: dict) -> dict:
    response = httpx.post(live.url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error", error
    return error


def test_a_message_that_starts_with_another_field_still_names_its_own(live, monkeypatch):
    """The text-parsing bug: the first word of "temperature and top_p are fine; ..."
    would have been the param. The engine's field is what the client gets."""
    message = "temperature and top_p are fine; token 7 of logit_bias is banned here"

    def check_params(params: SamplingParams) -> None:
        raise ValidationError(message, "logit_bias")

    monkeypatch.setattr(live.state.engine, "check_params", check_params)
    for path, body in [(COMPLETIONS, {"prompt": "hi"}), (CHAT, {"messages": HELLO})]:
        error = error_of(live, path, {**body, "logit_bias": {"7": -100}})
        assert (error["param"], error["message"]) == ("logit_bias", message)


def test_an_engine_refusal_no_route_catches_still_names_its_field(live, monkeypatch):
    """The app-wide handler maps a ValidationError that reaches it the same way."""
    def generate(*args, **kwargs):
        raise ValidationError("stop_token_ids and stop were fine; seed is taken", "seed")

    monkeypatch.setattr(live.state.engine, "generate", generate)
    error = error_of(live, COMPLETIONS, {"prompt": "hi", "seed": 3})
    assert error["param"] == "seed", error


@pytest.mark.parametrize("path, body, param", [
    # Past msgspec's bounds, refused by SamplingParams itself.
    (CHAT, {"messages": HELLO, "stop": ""}, "stop"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 1e-300}, "top_p"),
    (CHAT, {"messages": HELLO, "repetition_penalty": 1e-300}, "repetition_penalty"),
    # Its message names max_tokens too; chat sent max_completion_tokens.
    (CHAT, {"messages": HELLO, "max_completion_tokens": 2, "min_tokens": 5}, "min_tokens"),
    # The engine's check_params and check_prompt.
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    (COMPLETIONS, {"prompt": [1, VOCAB]}, "prompt"),
])
def test_engine_refusals_name_the_request_field(live, path, body, param):
    assert error_of(live, path, body)["param"] == param


def test_a_chat_prompt_the_engine_refuses_names_the_messages(live):
    """The engine names "prompt"; chat's prompt is its messages. Short words: the
    text passes the size check by characters and is refused by its tokens."""
    error = error_of(live, CHAT, {"messages": [{"role": "user", "content": "a " * 300}]})
    assert error["param"] == "messages", error
    assert "the prompt has" in error["message"], error
