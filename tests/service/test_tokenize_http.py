"""/tokenize and /detokenize over HTTP: the counts serving reports for the same
chat (tools included) and prompt, text back from ids, and the refusals."""

from __future__ import annotations

import httpx
import pytest

from live_server import run_server, tiny_config

pytestmark = pytest.mark.usefixtures("single_thread")

TOOLS = [{"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def live(tiny_llama_path):
    with run_server(tiny_config(tiny_llama_path, api_keys=("k",))) as server:
        yield server


def post(live, path, body, key="k"):
    return httpx.post(f"{live.url}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"} if key else {})


@pytest.mark.parametrize("tools", [{}, {"tools": TOOLS, "tool_choice": "required"}],
                         ids=["plain", "tools"])
def test_a_chats_count_is_what_serving_reports(live, tools):
    counted = post(live, "/tokenize", {"messages": MESSAGES, **tools}).json()
    served = post(live, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                                 **tools}).json()
    assert counted["count"] == served["usage"]["prompt_tokens"] == len(counted["tokens"])
    assert counted["max_model_len"] == 256


def test_a_prompts_count_is_what_completions_reports_and_decodes_back(live):
    prompt = "The quick brown fox jumps over the lazy dog."
    counted = post(live, "/tokenize", {"prompt": prompt, "return_token_strs": True}).json()
    served = post(live, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()
    assert counted["count"] == served["usage"]["prompt_tokens"]
    assert len(counted["token_strs"]) == counted["count"]
    bare = post(live, "/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()
    assert post(live, "/detokenize", {"tokens": bare["tokens"]}).json() == {"prompt": prompt}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "temperature": 0.5}, "temperature"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
])
def test_refusals_name_the_field(live, path, body, param):
    response = post(live, path, body)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param


def test_both_need_a_key(live):
    assert post(live, "/tokenize", {"prompt": "x"}, key=None).status_code == 401
    assert post(live, "/detokenize", {"tokens": [1]}, key=None).status_code == 401


def test_detokenize_at_the_vocabularys_edge(live):
    """The last id decodes; the vocabulary's size itself is the first id refused."""
    vocab = len(live.state.tokenizer)
    last = post(live, "/detokenize", {"tokens": [vocab - 1]})
    assert last.status_code == 200 and last.json()["prompt"], last.text
    refused = post(live, "/detokenize", {"tokens": [vocab]})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "tokens"
    assert f"(0..{vocab - 1})" in refused.json()["error"]["message"]


def test_tokenize_reaches_the_vocabularys_last_id(live):
    """The last id is inside on both routes: its text tokenizes back to it, named
    in token_strs; with the first id past the vocabulary beside it, /detokenize
    refuses the request by that id."""
    vocab = len(live.state.tokenizer)
    text = post(live, "/detokenize", {"tokens": [vocab - 1]}).json()["prompt"]
    got = post(live, "/tokenize", {"prompt": text, "add_special_tokens": False,
                                   "return_token_strs": True}).json()
    assert got["tokens"] == [vocab - 1] and got["count"] == 1, got
    assert got["token_strs"] == live.state.tokenizer.convert_ids_to_tokens([vocab - 1])
    refused = post(live, "/detokenize", {"tokens": [vocab - 1, vocab]})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["message"].startswith(f"token id {vocab} ")
