"""Completions' echo, max_tokens 0 and vLLM's prompt_logprobs over HTTP, on the tiny
random Llama, prefilled in 16-token chunks.

The expectations come from HF transformers in float32 (the log-softmax of the
whole prompt) and from the same request without echo, never from the server.
The first test sends lm-evaluation-harness's loglikelihood body exactly as it
does, and reads the answer as it does.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from live_server import LiveServer, run_server, tiny_config

PAIRS = [("The capital of France is", " Paris"),
         ("Two plus two equals", " four, said the teacher."),
         ("Once upon a time", " there was a princess")]
TOLERANCE = 1e-4

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def live(tiny_llama_path):
    config = tiny_config(tiny_llama_path, engine={"max_num_batched_tokens": 16})
    with run_server(config) as server:
        yield server


@pytest.fixture(scope="module")
def hf(tiny_llama_path):
    """(tokenizer, text -> (token ids, HF's float32 log-softmax at every position))."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_path))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_path), dtype=torch.float32)

    def logprobs(text: str):
        ids = tokenizer.encode(text)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        return ids, torch.log_softmax(logits, -1)

    return tokenizer, logprobs


def post(live: LiveServer, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(live.url + path, json=body, timeout=120)


def test_lm_eval_loglikelihood_request_is_answered_as_it_expects(live, hf):
    _, reference = hf
    body = {"model": "tiny", "prompt": [c + x for c, x in PAIRS], "temperature": 0,
            "max_tokens": 0, "logprobs": 1, "seed": 1234, "echo": True}
    response = post(live, body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["usage"]["completion_tokens"] == 0
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    for (context, continuation), choice in zip(PAIRS, choices):
        assert choice["text"] == context + continuation
        assert choice["finish_reason"] == "length"
        logprobs = choice["logprobs"]
        ids, expected = reference(context + continuation)
        assert len(logprobs["tokens"]) == len(ids)
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        # lm-eval: the continuation starts at the first token at or past the context's end
        offsets = logprobs["text_offset"]
        assert offsets == sorted(offsets) and offsets[0] == 0
        start = next(i for i, offset in enumerate(offsets) if offset >= len(context))
        total = sum(logprobs["token_logprobs"][start:])
        hf_total = sum(expected[i - 1, ids[i]].item() for i in range(start, len(ids)))
        assert abs(total - hf_total) < TOLERANCE * (len(ids) - start)
        # ... and is greedy when each token is its position's likeliest
        greedy = all(lp == max(top.values()) for lp, top in
                     zip(logprobs["token_logprobs"][start:], logprobs["top_logprobs"][start:]))
        hf_greedy = all(expected[i - 1].argmax().item() == ids[i] for i in range(start, len(ids)))
        assert greedy == hf_greedy
        for i in range(1, len(ids)):
            top = logprobs["top_logprobs"][i]
            assert len(top) in (1, 2)  # the prompt token, and the top 1 if another
            assert abs(max(top.values()) - expected[i - 1].max().item()) < TOLERANCE


def test_echo_puts_the_prompt_before_the_output(live):
    prompt = "Paged attention splits the cache"
    plain = post(live, {"prompt": prompt, "max_tokens": 4, "temperature": 0,
                        "logprobs": 2}).json()["choices"][0]
    echoed = post(live, {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2,
                         "echo": True}).json()["choices"][0]
    assert echoed["text"] == prompt + plain["text"]
    logprobs, output = echoed["logprobs"], plain["logprobs"]
    n = len(logprobs["tokens"]) - len(output["tokens"])
    assert n > 1
    assert logprobs["tokens"][n:] == output["tokens"]
    assert logprobs["token_logprobs"][n:] == pytest.approx(output["token_logprobs"], abs=1e-5)
    assert logprobs["text_offset"][n:] == [len(prompt) + o for o in output["text_offset"]]
    assert "".join(logprobs["tokens"][:n]).endswith(prompt)  # (a BOS token would come first)
    assert all(0 < len(top) <= 3 for top in logprobs["top_logprobs"][1:n])


def test_a_streamed_echo_sends_the_prompt_in_the_first_chunk(live):
    body = {"prompt": ["A first prompt", "and a second one"], "max_tokens": 3,
            "temperature": 0, "logprobs": 1, "echo": True}
    whole = post(live, body).json()["choices"]
    texts, tokens = {}, {}
    with httpx.stream("POST", live.url + "/v1/completions", json={**body, "stream": True},
                      timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                i = choice["index"]
                if i not in texts:
                    assert choice["text"].startswith(body["prompt"][i])
                texts[i] = texts.get(i, "") + choice["text"]
                tokens[i] = tokens.get(i, []) + choice["logprobs"]["tokens"]
    for choice in whole:
        assert texts[choice["index"]] == choice["text"]
        assert tokens[choice["index"]] == choice["logprobs"]["tokens"]


def test_token_id_prompts_echo_their_decoded_text(live, hf):
    tokenizer, _ = hf
    ids = tokenizer.encode("Hello, world")
    choice = post(live, {"prompt": [ids], "max_tokens": 0, "echo": True}).json()["choices"][0]
    assert choice["text"] == tokenizer.decode(ids)
    assert choice["logprobs"] is None and choice["finish_reason"] == "length"


def test_prompt_logprobs_on_both_routes(live, hf):
    tokenizer, reference = hf
    text = PAIRS[0][0] + PAIRS[0][1]
    ids, expected = reference(text)
    choice = post(live, {"prompt": text, "max_tokens": 1,
                         "prompt_logprobs": 2}).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        entry = entries[i]
        assert str(ids[i]) in entry and len(entry) in (2, 3)
        for token_id, logprob in entry.items():
            assert abs(logprob["logprob"] - expected[i - 1, int(token_id)].item()) < TOLERANCE
            assert logprob["decoded_token"] == tokenizer.decode([int(token_id)])
        assert {e["rank"] for t, e in entry.items() if t != str(ids[i])} <= {1, 2}
    assert post(live, {"prompt": text, "max_tokens": 1}).json()["choices"][0][
        "prompt_logprobs"] is None
    chat = post(live, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                       "prompt_logprobs": 0}, "/v1/chat/completions").json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])  # the token alone


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 0}, "max_tokens"),
])
def test_what_is_refused_is_named(live, path, body, param):
    response = post(live, body, path)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
