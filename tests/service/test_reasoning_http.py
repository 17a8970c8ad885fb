"""`pagedserve serve --reasoning-parser qwen3` as a deployment runs it (a child
process), through the official `openai` SDK: a thought comes back as
`reasoning_content` (and vLLM's newer `reasoning`), the answer as `content`.

How the tiny random model comes to think, deterministically and without
mocks (tests/tiny_models.py): its tokenizer is SmolLM2's plus `<think>` and
`</think>` as added tokens (not special, as in Qwen3's), with embedding and
head rows of their own; its chat template ends the generation prompt with
"<think>\\n", as Qwen3's thinking templates do, so the output starts inside a
thought. A random model never closes one, so `teach_to_end_thought` sets the
head row of `</think>` to 1.5 times the row of the token HF's greedy decoding
writes a few steps in: greedy decoding then writes `</think>` there, once,
and goes on answering. Every expectation is HF's greedy output for the same
prompt, decoded by the HF tokenizer, never the server's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from live_server import child_healthy, free_port, wait_until
from tiny_models import THINK_TOKENS, make_tiny_thinker, teach_to_end_thought

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 24
MESSAGES = [{"role": "user", "content": "What is two plus two?"}]


@dataclass
class Thinker:
    url: str
    client: "openai.OpenAI"
    tokenizer: object
    thought: str  # HF's greedy output before </think>
    answer: str  # and after it

    def chat(self, **kwargs):
        return self.client.chat.completions.create(
            model="thinker", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, **kwargs)


def start(folder: Path, log: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`pagedserve serve` on the folder in a child process, and its URL."""
    port = free_port()
    command = [sys.executable, "-m", "pagedserve", "serve", "--model", str(folder),
               "--served-model-name", "thinker", "--port", str(port), "--dtype", "float32",
               "--max-model-len", "256", "--kv-cache-memory-bytes", str(32 << 20),
               "--num-threads", "1", *flags]
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return process, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def thinker(tmp_path_factory, smollm2_path):
    from transformers import AutoTokenizer

    folder = make_tiny_thinker(tmp_path_factory.mktemp("thinker"), smollm2_path)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<think>\n")
    taught = teach_to_end_thought(folder, tokenizer.encode(prompt, add_special_tokens=False),
                                  MAX_TOKENS)
    thought, answer = tokenizer.decode(taught).split(THINK_TOKENS[1])
    log = tmp_path_factory.mktemp("logs") / "server.log"
    process, url = start(folder, log, "--reasoning-parser", "qwen3")
    try:
        up = wait_until(lambda: child_healthy(process, url, log.read_text), timeout=180,
                        interval=0.2)
        if not up:
            raise TimeoutError(f"the server did not become healthy:\n{log.read_text()}")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        yield Thinker(url, client, tokenizer, thought, answer)
    finally:
        process.kill()
        process.wait(30)


def reasoning_of(message_or_delta) -> str | None:
    """The thought under vLLM's two names, which must agree."""
    extra = message_or_delta.model_extra or {}
    assert extra.get("reasoning_content") == extra.get("reasoning")
    return extra.get("reasoning_content")


def test_a_stream_sends_the_thought_then_the_answer(thinker):
    kinds: dict[int, list[str]] = {0: [], 1: []}
    thought, answer = {0: "", 1: ""}, {0: "", 1: ""}
    for chunk in thinker.chat(stream=True, n=2):  # each choice has a parser of its own
        for choice in chunk.choices:
            delta, i = choice.delta, choice.index
            reasoning = reasoning_of(delta)
            for kind, text in (("reasoning", reasoning), ("content", delta.content)):
                if text:
                    kinds[i].append(kind)
                    assert "<think>" not in text and "</think>" not in text
            thought[i] += reasoning or ""
            answer[i] += delta.content or ""
    for i in (0, 1):
        assert (thought[i], answer[i]) == (thinker.thought, thinker.answer)
        first_answer = kinds[i].index("content")
        assert first_answer > 0 and "reasoning" not in kinds[i][first_answer:], kinds[i]


def test_a_whole_answer_has_both(thinker):
    response = thinker.chat(n=2)
    for choice in response.choices:
        assert reasoning_of(choice.message) == thinker.thought
        assert choice.message.content == thinker.answer
        assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 2 * MAX_TOKENS


def test_enable_thinking_false_is_all_content(thinker):
    response = thinker.chat(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = response.choices[0].message
    assert reasoning_of(message) is None and message.content
    # The template got the flag: the prompt holds the empty, closed thought.
    prompt = thinker.tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                   add_generation_prompt=True,
                                                   enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n")
    ids = thinker.tokenizer.encode(prompt, add_special_tokens=False)
    assert response.usage.prompt_tokens == len(ids)
    streamed = "".join(c.choices[0].delta.content or "" for c in thinker.chat(
        stream=True, extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    assert streamed == message.content


def test_a_constrained_output_is_all_content(thinker):
    response = thinker.chat(extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    message = response.choices[0].message
    assert reasoning_of(message) is None and message.content in ("yes", "no")


@pytest.mark.parametrize("kwargs, param", [
    ({"tokenize": True}, "chat_template_kwargs.tokenize"),
    ({"messages": []}, "chat_template_kwargs.messages"),
    ({"enable_thinking": "no"}, "chat_template_kwargs.enable_thinking"),
])
def test_chat_template_kwargs_that_are_no_template_variables_are_refused(thinker, kwargs, param):
    body = {"model": "thinker", "messages": MESSAGES, "max_tokens": 2,
            "chat_template_kwargs": kwargs}
    response = httpx.post(f"{thinker.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_flag_is_refused_for_a_model_that_cannot_think(tiny_llama_path, tmp_path):
    log = tmp_path / "server.log"
    process, _ = start(tiny_llama_path, log, "--reasoning-parser", "deepseek_r1")
    try:
        assert process.wait(120) != 0
    finally:
        if process.poll() is None:
            process.kill()
    assert "has no <think> or </think> token" in log.read_text()
