"""The server through the official `openai` SDK (and raw httpx where the SDK hides
the wire): chat and text completions, streaming and not, on the tiny random
Llama and on the real SmolLM2.

Every expectation is computed independently of the server: prompt token counts
with the HF tokenizer, greedy outputs with HF transformers (tiny model) and the
offline engine (SmolLM2), streamed text against the same request unstreamed.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from live_server import LiveServer

SMOLLM2_NAME = "smollm2-135m-instruct"
# Long enough to fill several 16-token KV blocks on its own.
LONG_TEXT = (
    "Paged attention splits the key/value cache of every request into fixed-size blocks. "
    "A block table maps each logical block of a sequence to a physical block in a shared "
    "pool, so memory is handed out on demand and returned the moment a request finishes. "
    "Requests that share a prefix, such as a common system prompt, can share its blocks. "
)


# On a busy 2-core machine two OpenMP threads make small ops wait on each other.
pytestmark = pytest.mark.usefixtures("single_thread")


@dataclass
class Served:
    """A live server plus what a test needs to check it independently."""

    live: LiveServer
    name: str  # the served model name
    path: Path  # the HF folder, for an independent tokenizer
    tokenizer: object
    client: openai.OpenAI

    @property
    def is_tiny(self) -> bool:
        return self.name == "tiny"

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.live.url + "/v1", api_key="unused",
                                  max_retries=0, timeout=120)

    def chat_prompt_ids(self, messages) -> list[int]:
        """The rendered chat prompt as the model sees it, computed here, not by the server."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat(self, messages, **kwargs):
        return self.client.chat.completions.create(model=self.name, messages=messages, **kwargs)

    def complete(self, prompt, **kwargs):
        return self.client.completions.create(model=self.name, prompt=prompt, **kwargs)


def make_served(live: LiveServer, name: str, path: Path) -> Served:
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    return Served(live, name, path, AutoTokenizer.from_pretrained(str(path)), client)


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def served(request, tiny_llama_path, smollm2_path) -> Served:
    if request.param == "tiny":
        return make_served(request.getfixturevalue("tiny_server"), "tiny", tiny_llama_path)
    return make_served(request.getfixturevalue("smollm2_server"), SMOLLM2_NAME, smollm2_path)


@pytest.fixture(scope="module")
def tiny(tiny_server, tiny_llama_path) -> Served:
    return make_served(tiny_server, "tiny", tiny_llama_path)


@pytest.fixture(scope="module")
def smollm2(smollm2_server, smollm2_path) -> Served:
    return make_served(smollm2_server, SMOLLM2_NAME, smollm2_path)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# -- collecting streams ---------------------------------------------------------------
@dataclass
class Collected:
    texts: list[str]
    finish_reasons: list[str | None]
    logprob_tokens: list[list[str]]  # per choice, the token strings of the logprobs
    usage: object | None
    chunks: list


def collect_chat(stream, n: int = 1) -> Collected:
    chunks = list(stream)
    texts, finish, tokens = [""] * n, [None] * n, [[] for _ in range(n)]
    usage = None
    seen_role = [False] * n
    for position, chunk in enumerate(chunks):
        assert chunk.object == "chat.completion.chunk"
        assert chunk.id == chunks[0].id
        if chunk.usage is not None:
            # The usage chunk comes last, alone, with no choices.
            assert position == len(chunks) - 1, "usage must be the final chunk"
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            i = choice.index
            assert 0 <= i < n
            assert finish[i] is None, f"choice {i} got a chunk after its finish_reason"
            if not seen_role[i]:
                assert choice.delta.role == "assistant", "the first delta carries the role"
                seen_role[i] = True
            texts[i] += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                tokens[i] += [entry.token for entry in choice.logprobs.content]
            if choice.finish_reason is not None:
                finish[i] = choice.finish_reason
    assert all(seen_role)
    return Collected(texts, finish, tokens, usage, chunks)


def collect_completion(stream, num_choices: int = 1) -> Collected:
    chunks = list(stream)
    texts, finish = [""] * num_choices, [None] * num_choices
    tokens = [[] for _ in range(num_choices)]
    usage = None
    for position, chunk in enumerate(chunks):
        assert chunk.object == "text_completion"
        if chunk.usage is not None:
            assert position == len(chunks) - 1, "usage must be the final chunk"
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            i = choice.index
            assert 0 <= i < num_choices
            assert finish[i] is None, f"choice {i} got a chunk after its finish_reason"
            texts[i] += choice.text
            if choice.logprobs is not None:
                tokens[i] += choice.logprobs.tokens
            if choice.finish_reason is not None:
                finish[i] = choice.finish_reason
    return Collected(texts, finish, tokens, usage, chunks)


def assert_usage_sums(usage) -> None:
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens is not None
    assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens


# -- /v1/models -----------------------------------------------------------------------
def test_models_lists_the_served_name(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == [served.name]
    assert models.data[0].owned_by
    # Every response names the model it came from.
    reply = served.chat(user("Hi"), max_tokens=2, temperature=0)
    assert reply.model == served.name


def test_unknown_model_is_404(served):
    with pytest.raises(openai.NotFoundError):
        served.client.chat.completions.create(model="no-such-model", messages=user("Hi"),
                                              max_tokens=2)


# -- chat -----------------------------------------------------------------------------
def test_chat_stream_equals_non_stream_and_usage_is_exact(served):
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three colours of the rainbow."},
    ]
    expected_prompt = len(served.chat_prompt_ids(messages))
    kwargs = dict(max_tokens=24, temperature=0, logprobs=True, top_logprobs=1)

    reply = served.chat(messages, **kwargs)
    assert reply.object == "chat.completion"
    assert len(reply.choices) == 1
    choice = reply.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.prompt_tokens == expected_prompt
    # One logprobs entry per generated token.
    assert usage.completion_tokens == len(choice.logprobs.content) > 0
    if choice.finish_reason == "length":
        assert usage.completion_tokens == 24
    assert_usage_sums(usage)

    streamed = collect_chat(served.chat(messages, stream=True,
                                        stream_options={"include_usage": True}, **kwargs))
    assert streamed.texts[0] == choice.message.content
    assert streamed.finish_reasons[0] == choice.finish_reason
    assert streamed.logprob_tokens[0] == [e.token for e in choice.logprobs.content]
    assert streamed.usage is not None
    assert streamed.usage.prompt_tokens == expected_prompt
    assert streamed.usage.completion_tokens == usage.completion_tokens
    assert_usage_sums(streamed.usage)


def test_chat_stream_without_include_usage_has_no_usage(served):
    streamed = collect_chat(served.chat(user("Say hello."), max_tokens=4, temperature=0,
                                        stream=True))
    assert streamed.usage is None
    assert all(chunk.usage is None for chunk in streamed.chunks)
    assert streamed.finish_reasons[0] is not None


def test_chat_max_tokens_gives_length(served):
    kwargs = dict(max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    reply = served.chat(user("Tell me a long story about a dragon."), **kwargs)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3
    streamed = collect_chat(served.chat(user("Tell me a long story about a dragon."),
                                        stream=True, stream_options={"include_usage": True},
                                        **kwargs))
    assert streamed.finish_reasons == ["length"]
    assert streamed.texts[0] == reply.choices[0].message.content
    assert streamed.usage.completion_tokens == 3


def test_max_completion_tokens_is_honoured(served):
    reply = served.client.chat.completions.create(
        model=served.name, messages=user("Count to twenty."), max_completion_tokens=4,
        temperature=0, extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 4


def test_cached_tokens_for_a_repeated_long_prompt(served):
    block_size = served.live.engine.config.block_size
    messages = user(f"[{uuid.uuid4().hex}] Summarise this: " + LONG_TEXT)
    first = served.chat(messages, max_tokens=2, temperature=0)
    second = served.chat(messages, max_tokens=2, temperature=0)
    prompt_tokens = len(served.chat_prompt_ids(messages))
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == prompt_tokens
    assert prompt_tokens > 4 * block_size
    first_cached = first.usage.prompt_tokens_details.cached_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > first_cached
    # Every full block of the prompt is found again (at least one token is recomputed).
    assert ((prompt_tokens - 1) // block_size) * block_size <= cached < prompt_tokens

    # Text completions: a prompt that starts with a fresh id shares no block at first.
    prompt = f"{uuid.uuid4().hex} " + LONG_TEXT
    first = served.complete(prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    streamed = collect_completion(served.complete(
        prompt, max_tokens=2, temperature=0, stream=True, stream_options={"include_usage": True}
    ))
    assert streamed.usage.prompt_tokens_details.cached_tokens >= (
        (first.usage.prompt_tokens - 1) // block_size) * block_size > 0


def test_chat_stop_string(served):
    messages = user("Write one sentence about the moon and the stars.")
    kwargs = dict(max_tokens=20, temperature=0, logprobs=True, extra_body={"ignore_eos": True})
    full = served.chat(messages, **kwargs).choices[0]
    tokens = [e.token for e in full.logprobs.content]
    stop, cut = pick_stop(full.message.content, tokens)

    reply = served.chat(messages, stop=[stop], **kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == full.message.content[:cut]
    assert stop not in choice.message.content
    assert choice.stop_reason == stop
    # The tokens up to the one that completed the stop string were generated.
    assert reply.usage.completion_tokens == len(choice.logprobs.content)
    assert [e.token for e in choice.logprobs.content] == tokens[:len(choice.logprobs.content)]
    assert reply.usage.completion_tokens < 20

    streamed = collect_chat(served.chat(messages, stop=stop, stream=True, **kwargs))
    assert streamed.texts[0] == choice.message.content
    assert streamed.finish_reasons == ["stop"]


def pick_stop(text: str, tokens: list[str]) -> tuple[str, int]:
    """A word the greedy output produces after its first few tokens, and where it starts."""
    for token in tokens[2:]:
        word = token.strip()
        if len(word) >= 2 and word.isascii() and word.isalpha():
            cut = text.find(word)
            if cut > 0:
                return word, cut
    pytest.fail(f"no usable stop word in {tokens!r}")


def test_chat_n2_with_seed(served):
    messages = user("Write a short poem about the sea.")
    kwargs = dict(n=2, max_tokens=10, temperature=0.8, seed=7, extra_body={"ignore_eos": True})
    reply = served.chat(messages, **kwargs)
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage.completion_tokens == 20
    assert reply.usage.prompt_tokens == len(served.chat_prompt_ids(messages))
    # Sample j is seeded with seed + j: two different samples.
    assert reply.choices[0].message.content != reply.choices[1].message.content

    streamed = collect_chat(served.chat(messages, stream=True,
                                        stream_options={"include_usage": True}, **kwargs), n=2)
    assert streamed.texts == [c.message.content for c in reply.choices]
    assert streamed.finish_reasons == ["length", "length"]
    assert streamed.usage.completion_tokens == 20


def test_seeded_sampling_is_reproducible(served):
    messages = user("Invent a name for a new planet.")
    kwargs = dict(max_tokens=12, temperature=0.8, extra_body={"ignore_eos": True})
    first = served.chat(messages, seed=7, **kwargs).choices[0].message.content
    second = served.chat(messages, seed=7, **kwargs).choices[0].message.content
    assert first == second
    # The seed matters: some other seed samples something else.
    others = {served.chat(messages, seed=seed, **kwargs).choices[0].message.content
              for seed in (8, 9, 10)}
    assert others != {first}

    prompt = "Once upon a time"
    a = served.complete(prompt, seed=7, **kwargs).choices[0].text
    b = served.complete(prompt, seed=7, **kwargs).choices[0].text
    assert a == b


def test_chat_logprobs_shape(served):
    top = 3
    reply = served.chat(user("What is two plus two?"), max_tokens=8, temperature=0,
                        logprobs=True, top_logprobs=top)
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens > 0
    for entry in content:
        assert entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == top
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
    joined = "".join(e.token for e in content)
    if "\ufffd" not in joined and choice.finish_reason == "length":
        assert joined == choice.message.content

    # No logprobs unless asked for.
    plain = served.chat(user("What is two plus two?"), max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_async_client_chat(served):
    async def run():
        async with served.async_client() as client:
            kwargs = dict(model=served.name, messages=user("Give me a fruit."), max_tokens=8,
                          temperature=0)
            reply = await client.chat.completions.create(**kwargs)
            stream = await client.chat.completions.create(stream=True, **kwargs)
            text = ""
            async for chunk in stream:
                for choice in chunk.choices:
                    text += choice.delta.content or ""
            return reply.choices[0].message.content, text

    unstreamed, streamed = asyncio.run(run())
    assert streamed == unstreamed


# -- text completions -----------------------------------------------------------------
def test_completion_stream_equals_non_stream_and_usage_is_exact(served):
    prompt = "The three primary colours are"
    kwargs = dict(max_tokens=16, temperature=0, logprobs=1)
    reply = served.complete(prompt, **kwargs)
    assert reply.object == "text_completion"
    choice = reply.choices[0]
    assert choice.index == 0
    assert reply.usage.prompt_tokens == len(served.tokenizer.encode(prompt))
    assert reply.usage.completion_tokens == len(choice.logprobs.tokens) > 0
    assert_usage_sums(reply.usage)

    streamed = collect_completion(served.complete(
        prompt, stream=True, stream_options={"include_usage": True}, **kwargs
    ))
    assert streamed.texts[0] == choice.text
    assert streamed.finish_reasons[0] == choice.finish_reason
    assert streamed.logprob_tokens[0] == choice.logprobs.tokens
    assert streamed.usage.prompt_tokens == reply.usage.prompt_tokens
    assert streamed.usage.completion_tokens == reply.usage.completion_tokens
    assert_usage_sums(streamed.usage)


def test_completion_default_max_tokens_and_length(served):
    reply = served.complete("List the planets:", temperature=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 16  # OpenAI's default for /v1/completions


def test_completion_stop_string(served):
    prompt = "A short description of the ocean:"
    kwargs = dict(max_tokens=20, temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    full = served.complete(prompt, **kwargs).choices[0]
    stop, cut = pick_stop(full.text, full.logprobs.tokens)

    reply = served.complete(prompt, stop=[stop, "\u2603never"], **kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == full.text[:cut]
    assert stop not in choice.text
    assert reply.usage.completion_tokens == len(choice.logprobs.tokens) < 20

    streamed = collect_completion(served.complete(prompt, stop=stop, stream=True, **kwargs))
    assert streamed.texts[0] == choice.text
    assert streamed.finish_reasons == ["stop"]


def test_completion_logprobs_shape(served):
    reply = served.complete("The weather today is", max_tokens=8, temperature=0, logprobs=2)
    choice = reply.choices[0]
    lp = choice.logprobs
    count = reply.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == count > 0
    assert len(lp.text_offset) == count
    offset = 0
    for token, value, tops, text_offset in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                               lp.text_offset):
        assert text_offset == offset
        offset += len(token)
        assert value <= 0
        # Two candidates (fewer only if two ids decode to the same string).
        assert 1 <= len(tops) <= 2
        assert max(tops.values()) == pytest.approx(value, abs=1e-5)  # greedy
        assert tops[token] == pytest.approx(value, abs=1e-5)

    # The same token strings and offsets when streamed.
    streamed = list(served.complete("The weather today is", max_tokens=8, temperature=0,
                                    logprobs=2, stream=True))
    tokens = [t for chunk in streamed for c in chunk.choices for t in c.logprobs.tokens]
    offsets = [o for chunk in streamed for c in chunk.choices for o in c.logprobs.text_offset]
    assert tokens == lp.tokens
    assert offsets == lp.text_offset


def test_completion_token_id_prompt(served):
    text = "Paged attention is"
    ids = served.tokenizer.encode(text)
    by_text = served.complete(text, max_tokens=8, temperature=0)
    by_ids = served.complete(ids, max_tokens=8, temperature=0)
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.choices[0].finish_reason == by_text.choices[0].finish_reason


def test_completion_batch_of_two_prompts(served):
    prompts = ["The capital of France is", "My favourite animal is the"]
    kwargs = dict(max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    alone = [served.complete(p, **kwargs) for p in prompts]
    batch = served.complete(prompts, **kwargs)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [r.choices[0].text for r in alone]
    assert batch.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
    assert batch.usage.completion_tokens == 16
    assert_usage_sums(batch.usage)

    streamed = collect_completion(served.complete(
        prompts, stream=True, stream_options={"include_usage": True}, **kwargs
    ), num_choices=2)
    assert streamed.texts == [c.text for c in batch.choices]
    assert streamed.finish_reasons == ["length", "length"]
    assert streamed.usage.prompt_tokens == batch.usage.prompt_tokens
    assert streamed.usage.completion_tokens == 16

    # n samples per prompt: choice i*n + j is sample j of prompt i.
    sampled = served.complete(prompts, n=2, max_tokens=4, temperature=0.8, seed=3,
                              extra_body={"ignore_eos": True})
    assert [c.index for c in sampled.choices] == [0, 1, 2, 3]
    assert sampled.usage.completion_tokens == 16
    again = served.complete(prompts[1], n=2, max_tokens=4, temperature=0.8, seed=3,
                            extra_body={"ignore_eos": True})
    assert [c.text for c in sampled.choices[2:]] == [c.text for c in again.choices]


# -- the raw wire -----------------------------------------------------------------------
def sse_events(body: str) -> list[str]:
    """The data payloads of an SSE body; comments (keep-alive pings) are skipped."""
    body = body.replace("\r\n", "\n")
    assert body.endswith("\n\n"), "the stream must end with a complete event"
    payloads = []
    for block in body.split("\n\n")[:-1]:
        lines = block.split("\n")
        if all(line.startswith(":") for line in lines):
            continue
        assert len(lines) == 1 and lines[0].startswith("data: "), f"bad SSE event {block!r}"
        payloads.append(lines[0][len("data: "):])
    return payloads


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_raw_sse_ends_with_done(served, endpoint):
    if endpoint == "chat":
        path, body = "/v1/chat/completions", {"messages": user("Hello!")}
    else:
        path, body = "/v1/completions", {"prompt": "Hello"}
    body.update(model=served.name, max_tokens=6, temperature=0, stream=True,
                stream_options={"include_usage": True})
    with httpx.Client(base_url=served.live.url, timeout=120) as client:
        with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            raw = response.read().decode()
    payloads = sse_events(raw)
    assert payloads[-1] == "[DONE]"
    assert payloads.count("[DONE]") == 1
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len(chunks) >= 2
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    finishes = [c["finish_reason"] for chunk in chunks for c in chunk["choices"]]
    assert finishes[-1] in ("stop", "length")
    assert all(f is None for f in finishes[:-1])


# -- the server's greedy output against independent references ------------------------
def test_tiny_greedy_matches_hf_transformers(tiny):
    from hf_compare import hf_greedy

    num_tokens = 24
    ids = tiny.tokenizer.encode(LONG_TEXT * 2, add_special_tokens=False)
    prompts = [ids[:5], ids[7:47], ids[3:120]]
    reference = hf_greedy(tiny.path, prompts, num_tokens, "cpu")
    for prompt, (ref_ids, ref_tops) in zip(prompts, reference):
        reply = tiny.complete(prompt, max_tokens=num_tokens, temperature=0, logprobs=1,
                              extra_body={"ignore_eos": True})
        choice = reply.choices[0]
        assert choice.finish_reason == "length"
        assert reply.usage.prompt_tokens == len(prompt)
        assert reply.usage.completion_tokens == num_tokens
        # Token for token (as strings: the wire carries no ids) and as text.
        expected_tokens = [tiny.tokenizer.decode([t], skip_special_tokens=False)
                           for t in ref_ids]
        assert choice.logprobs.tokens == expected_tokens
        assert choice.text == tiny.tokenizer.decode(
            ref_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        # And the logprobs are HF's.
        ref_values = [tops[t] for t, tops in zip(ref_ids, ref_tops)]
        assert choice.logprobs.token_logprobs == pytest.approx(ref_values, abs=2e-3)


def test_smollm2_greedy_matches_offline_engine(smollm2):
    from engine import LLM, SamplingParams

    prompts = [
        smollm2.chat_prompt_ids(user("What is the capital of France?")),
        smollm2.tokenizer.encode("def fibonacci(n):"),
    ]
    llm = LLM(SMOLLM2_NAME, max_model_len=512, kv_cache_memory_bytes=64 << 20, dtype="float32",
              quantization="none")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    offline = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del llm
    for prompt, expected in zip(prompts, offline):
        reply = smollm2.complete(prompt, max_tokens=16, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert reply.choices[0].text == expected.outputs[0].text
    # The chat endpoint renders the same prompt the offline engine was given.
    chat = smollm2.chat(user("What is the capital of France?"), max_tokens=16, temperature=0,
                        extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == offline[0].outputs[0].text
    assert "Paris" in chat.choices[0].message.content
