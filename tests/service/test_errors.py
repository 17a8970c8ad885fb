"""Bad input, authentication, tenant isolation of the prefix cache, and CORS.

Every test talks HTTP to a real uvicorn server (tests/service/live_server.py)
on the tiny random Llama (max_model_len 256, vocabulary 49152). A refused
request must come back with the right status and OpenAI's error object:

    {"error": {"message": "...", "type": "...", "param": ..., "code": ...}}

and must leave the engine serving: the battery ends by sending normal
requests and checking that nothing leaked (no running request, every KV
block free, no stream left registered on the bridge).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from live_server import LiveServer, is_error_event, run_server, tiny_config, wait_until

KEYS = ("k1", "k2")
ORIGIN = "http://example.test"
MAX_MODEL_LEN = 256  # tiny_config's
VOCAB = 49152  # the tiny model's vocabulary (SmolLM2's tokenizer)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def keyed_server(tiny_llama_path):
    """Two API keys, a CORS allow-list, the default 4 MiB body limit."""
    config = tiny_config(tiny_llama_path, api_keys=KEYS, allowed_origins=(ORIGIN,))
    with run_server(config) as live:
        yield live


@pytest.fixture(scope="module")
def shared_server(tiny_llama_path):
    """Two API keys sharing one prefix cache, with /health and /metrics behind a
    key; its KV cache is int8 (the prefix cache test below runs on it)."""
    config = tiny_config(
        tiny_llama_path, engine={"kv_cache_dtype": "int8"}, api_keys=KEYS,
        share_prefix_cache_across_keys=True, protect_health_and_metrics=True,
    )
    with run_server(config) as live:
        yield live


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_error(response: httpx.Response, status: int, *fragments: str,
                 param: str | None = None, code: str | None = None) -> dict:
    """The status, OpenAI's error shape (all four keys), and what the message names."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    for fragment in fragments:
        assert fragment.lower() in error["message"].lower(), (fragment, error["message"])
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_idle(live: LiveServer) -> None:
    """Nothing running or waiting, every KV block free, no stream left on the bridge."""
    assert wait_until(lambda: live.metrics()["pagedserve:num_requests_running"] == 0, 5)
    metrics = live.metrics()
    assert metrics["pagedserve:num_requests_waiting"] == 0, metrics
    assert metrics["pagedserve:kv_blocks_free"] == metrics["pagedserve:kv_blocks_total"], metrics
    assert live.state.engine._streams == {}
    assert live.engine.block_manager.block_tables == {}
    live.engine.block_manager.check_invariants()


# -- the bad-input battery -------------------------------------------------------------
def chunked(total: int, piece: int = 1 << 16):
    """A body sent with Transfer-Encoding: chunked (no Content-Length to check up front)."""
    sent = 0
    while sent < total:
        size = min(piece, total - sent)
        sent += size
        yield b"x" * size


BAD = [
    # (id, method, path, request kwargs, status, message fragments, param, code)
    ("malformed-json", "POST", CHAT, dict(content=b'{"messages": [', ), 400,
     ["not valid json"], None, "invalid_json"),
    ("not-json-at-all", "POST", COMPLETIONS, dict(content=b"{bad json"), 400,
     ["not valid json"], None, "invalid_json"),
    ("empty-body", "POST", CHAT, dict(content=b""), 400, ["not valid json"], None,
     "invalid_json"),
    ("body-is-array", "POST", COMPLETIONS, dict(json=[]), 400, ["object"], None, None),
    ("max-tokens-string", "POST", CHAT, dict(json={"messages": HELLO, "max_tokens": "ten"}),
     400, ["max_tokens", "str"], "max_tokens", None),
    ("messages-string", "POST", CHAT, dict(json={"messages": "hello"}), 400,
     ["messages", "array"], "messages", None),
    ("temperature-string", "POST", COMPLETIONS,
     dict(json={"prompt": "hi", "temperature": "hot"}), 400, ["temperature"], "temperature",
     None),
    ("max-tokens-negative", "POST", CHAT, dict(json={"messages": HELLO, "max_tokens": -5}), 400,
     ["max_tokens", ">= 1"], "max_tokens", None),
    ("max-tokens-zero", "POST", COMPLETIONS, dict(json={"prompt": "hi", "max_tokens": 0}), 400,
     ["max_tokens"], "max_tokens", None),
    ("max-tokens-zero-chat", "POST", CHAT, dict(json={"messages": HELLO, "max_tokens": 0}), 400,
     ["max_tokens"], "max_tokens", None),
    # 0 must never fall through to "no limit" (chat takes max_completion_tokens first).
    ("max-completion-tokens-zero", "POST", CHAT,
     dict(json={"messages": HELLO, "max_completion_tokens": 0}), 400,
     ["max_completion_tokens"], "max_completion_tokens", None),
    ("max-completion-tokens-negative", "POST", CHAT,
     dict(json={"messages": HELLO, "max_completion_tokens": -3, "max_tokens": 5}), 400,
     ["max_completion_tokens"], "max_completion_tokens", None),
    ("temperature-negative", "POST", CHAT, dict(json={"messages": HELLO, "temperature": -1}),
     400, ["temperature", ">= 0"], "temperature", None),
    ("top-p-2", "POST", CHAT, dict(json={"messages": HELLO, "top_p": 2}), 400,
     ["top_p", "<= 1"], "top_p", None),
    ("top-p-2-completions", "POST", COMPLETIONS, dict(json={"prompt": "hi", "top_p": 2}), 400,
     ["top_p"], "top_p", None),
    ("messages-empty", "POST", CHAT, dict(json={"messages": []}), 400,
     ["messages", "length >= 1"], "messages", None),
    ("messages-missing", "POST", CHAT, dict(json={"model": "tiny"}), 400, ["messages"], None,
     None),
    ("role-unknown", "POST", CHAT, dict(json={"messages": [{"role": "wizard", "content": "x"}]}),
     400, ["wizard", "role"], "messages[0].role", None),
    ("content-part-image", "POST", CHAT, dict(json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.test/cat.png"}}]}]}),
     400, ["image_url"], "messages[0].content[0].type", None),
    ("n-too-large", "POST", CHAT, dict(json={"messages": HELLO, "n": 1000}), 400,
     ["n", "<= 16"], "n", None),
    ("n-zero", "POST", COMPLETIONS, dict(json={"prompt": "hi", "n": 0}), 400, ["n"], "n", None),
    ("stream-options-without-stream", "POST", CHAT,
     dict(json={"messages": HELLO, "stream_options": {"include_usage": True}}), 400,
     ["stream_options", "stream"], "stream_options", None),
    ("stream-options-without-stream-completions", "POST", COMPLETIONS,
     dict(json={"prompt": "hi", "stream": False, "stream_options": {"include_usage": True}}),
     400, ["stream_options"], "stream_options", None),
    ("prompt-mixed-types", "POST", COMPLETIONS, dict(json={"prompt": ["a", [1, 2]]}), 400,
     ["prompt must be"], "prompt", None),
    ("prompt-tokens-and-strings", "POST", COMPLETIONS, dict(json={"prompt": [1, "a"]}), 400,
     ["prompt must be"], "prompt", None),
    ("prompt-float-tokens", "POST", COMPLETIONS, dict(json={"prompt": [1.5, 2.0]}), 400,
     ["prompt must be"], "prompt", None),
    ("prompt-bool-tokens", "POST", COMPLETIONS, dict(json={"prompt": [True, False]}), 400,
     ["prompt must be"], "prompt", None),
    ("prompt-empty-inner-list", "POST", COMPLETIONS, dict(json={"prompt": [[]]}), 400,
     ["prompt"], "prompt", None),
    ("prompt-empty-list", "POST", COMPLETIONS, dict(json={"prompt": []}), 400, ["prompt"],
     "prompt", None),
    ("prompt-empty-string", "POST", COMPLETIONS, dict(json={"prompt": ""}), 400, ["empty"],
     "prompt", None),
    ("token-id-out-of-vocab", "POST", COMPLETIONS, dict(json={"prompt": [1, VOCAB]}), 400,
     [str(VOCAB), "vocabulary"], "prompt", None),
    ("token-id-huge", "POST", COMPLETIONS, dict(json={"prompt": [[1, 2], [3, 10**12]]}), 400,
     [str(10**12), "vocabulary"], "prompt", None),
    ("token-id-negative", "POST", COMPLETIONS, dict(json={"prompt": [5, -1]}), 400,
     ["-1", "vocabulary"], "prompt", None),
    ("prompt-over-max-model-len", "POST", COMPLETIONS,
     dict(json={"prompt": list(range(3, 303))}), 400, ["300 tokens", str(MAX_MODEL_LEN)],
     "prompt", None),
    ("prompt-exactly-max-model-len", "POST", COMPLETIONS,
     dict(json={"prompt": [7] * MAX_MODEL_LEN}), 400, [f"{MAX_MODEL_LEN} tokens"], "prompt",
     None),
    ("chat-prompt-over-max-model-len", "POST", CHAT,
     dict(json={"messages": [{"role": "user", "content": "hello " * 400}]}), 400,
     ["tokens", str(MAX_MODEL_LEN)], "messages", None),
    ("top-logprobs-without-logprobs", "POST", CHAT,
     dict(json={"messages": HELLO, "top_logprobs": 2}), 400, ["logprobs"], "top_logprobs", None),
    ("max-tokens-0-without-echo", "POST", COMPLETIONS,
     dict(json={"prompt": "hi", "max_tokens": 0}), 400, ["echo"], "max_tokens", None),
    ("prompt-logprobs-streamed", "POST", COMPLETIONS,
     dict(json={"prompt": "hi", "prompt_logprobs": 1, "stream": True}), 400, ["stream"],
     "prompt_logprobs", None),
    ("body-10mb", "POST", CHAT, dict(content=b"x" * (10 << 20)), 413,
     ["larger than the limit", str(4 << 20)], None, "request_too_large"),
    ("body-chunked-over-limit", "POST", CHAT, dict(chunked=(4 << 20) + 1), 413,
     ["larger than the limit"], None, "request_too_large"),
    ("body-chunked-far-over-limit", "POST", COMPLETIONS, dict(chunked=10 << 20), 413,
     ["larger than the limit"], None, "request_too_large"),
    ("model-unknown", "POST", CHAT, dict(json={"messages": HELLO, "model": "gpt-9"}), 404,
     ["gpt-9"], "model", "model_not_found"),
    ("model-unknown-completions", "POST", COMPLETIONS,
     dict(json={"prompt": "hi", "model": "gpt-9"}), 404, ["gpt-9"], "model", "model_not_found"),
    ("route-unknown", "GET", "/v1/nope", {}, 404, ["/v1/nope"], None, "not_found"),
    ("route-unknown-post", "POST", "/v2/chat/completions", dict(json={"messages": HELLO}), 404,
     ["/v2/chat/completions"], None, "not_found"),
    ("method-not-allowed", "GET", CHAT, {}, 405, ["method"], None, None),
    ("api-key-wrong", "POST", CHAT, dict(json={"messages": HELLO}, headers=bearer("k3")), 401,
     ["api key"], None, "invalid_api_key"),
    ("api-key-prefix-of-a-key", "POST", CHAT, dict(json={"messages": HELLO}, headers=bearer("k")),
     401, ["api key"], None, "invalid_api_key"),
    ("api-key-missing", "POST", CHAT, dict(json={"messages": HELLO}, headers={}), 401,
     ["api key"], None, "invalid_api_key"),
    ("api-key-not-bearer", "POST", COMPLETIONS,
     dict(json={"prompt": "hi"}, headers={"Authorization": "Basic k1"}), 401, ["api key"], None,
     "invalid_api_key"),
    ("api-key-missing-models", "GET", "/v1/models", dict(headers={}), 401, ["api key"], None,
     "invalid_api_key"),
]


@pytest.mark.parametrize(
    "method,path,kwargs,status,fragments,param,code",
    [pytest.param(*case[1:], id=case[0]) for case in BAD],
)
def test_bad_request(keyed_server, method, path, kwargs, status, fragments, param, code):
    kwargs = dict(kwargs)
    headers = kwargs.pop("headers", bearer("k1"))
    if "chunked" in kwargs:  # a fresh generator per run: httpx sends it chunked
        kwargs["content"] = chunked(kwargs.pop("chunked"))
    with httpx.Client(base_url=keyed_server.url, timeout=60, headers=headers) as client:
        response = client.request(method, path, **kwargs)
    error = assert_error(response, status, *fragments)
    # param and code exactly, null included: a client branches on them, not on the text.
    assert (error["param"], error["code"]) == (param, code), error


@pytest.mark.parametrize("path,prompt_field", [(CHAT, "messages"), (COMPLETIONS, "prompt")])
def test_max_tokens_past_context_names_the_numbers(keyed_server, path, prompt_field):
    body = {"max_tokens": 10**6}
    if path == CHAT:
        body["messages"] = HELLO
    else:
        body["prompt"] = [11, 12, 13, 14, 15]
    response = httpx.post(keyed_server.url + path, json=body, headers=bearer("k1"), timeout=60)
    error = assert_error(response, 400, param="max_tokens")
    match = re.search(
        rf"maximum context length is (\d+) tokens; you requested (\d+) tokens "
        rf"\((\d+) in the {prompt_field}, (\d+) in the completion\)",
        error["message"],
    )
    assert match, error["message"]
    limit, total, prompt_len, completion = map(int, match.groups())
    assert limit == MAX_MODEL_LEN
    assert completion == 10**6
    assert total == prompt_len + completion
    if path == COMPLETIONS:
        assert prompt_len == 5


def test_max_tokens_that_just_fits_is_accepted(keyed_server):
    """The boundary of the check above: prompt + max_tokens == max_model_len works."""
    prompt = [21, 22, 23, 24]
    response = httpx.post(
        keyed_server.url + COMPLETIONS, headers=bearer("k1"), timeout=60,
        json={"prompt": prompt, "max_tokens": MAX_MODEL_LEN - len(prompt), "ignore_eos": True},
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - len(prompt)
    too_many = httpx.post(
        keyed_server.url + COMPLETIONS, headers=bearer("k1"), timeout=60,
        json={"prompt": prompt, "max_tokens": MAX_MODEL_LEN - len(prompt) + 1},
    )
    assert_error(too_many, 400, str(MAX_MODEL_LEN + 1), param="max_tokens")


def test_streaming_bad_request_is_an_http_error_not_a_stream(keyed_server):
    """Validation happens before the response starts: a plain JSON 400, no SSE."""
    response = httpx.post(
        keyed_server.url + CHAT, headers=bearer("k1"), timeout=60,
        json={"messages": HELLO, "stream": True, "temperature": -1},
    )
    assert_error(response, 400, "temperature", param="temperature")
    response = httpx.post(
        keyed_server.url + COMPLETIONS, headers=bearer("k1"), timeout=60,
        json={"prompt": [1, VOCAB + 5], "stream": True},
    )
    assert_error(response, 400, "vocabulary", param="prompt")


def test_still_serving_after_the_battery(keyed_server):
    """Every refusal above left the engine healthy and its state clean."""
    with httpx.Client(base_url=keyed_server.url, timeout=60, headers=bearer("k1")) as client:
        assert client.get("/health").status_code == 200
        chat = client.post(CHAT, json={"messages": HELLO, "max_tokens": 5, "ignore_eos": True})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] == 5
        text = client.post(COMPLETIONS, json={"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 4,
                                              "ignore_eos": True})
        assert text.status_code == 200, text.text
        assert [c["index"] for c in text.json()["choices"]] == [0, 1]
        # A chunked body under the limit goes through the byte-counting path untouched.
        body = b'{"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": true}'
        chunks = client.post(COMPLETIONS, content=(body[i:i + 7] for i in range(0, len(body), 7)))
        assert chunks.status_code == 200, chunks.text
        assert chunks.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                          "total_tokens": 5,
                                          "prompt_tokens_details": {"cached_tokens": 0}}
        with client.stream("POST", CHAT, json={"messages": HELLO, "max_tokens": 3,
                                               "stream": True, "ignore_eos": True}) as stream:
            assert stream.status_code == 200
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert not any(is_error_event(line) for line in lines)
    assert_idle(keyed_server)


# -- authentication ----------------------------------------------------------------------
def test_both_keys_work(keyed_server):
    for key in KEYS:
        response = httpx.post(keyed_server.url + CHAT, headers=bearer(key), timeout=60,
                              json={"messages": HELLO, "max_tokens": 2})
        assert response.status_code == 200, (key, response.text)
        models = httpx.get(keyed_server.url + "/v1/models", headers=bearer(key), timeout=30)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"


def cache_config(text: str) -> tuple[dict, float]:
    """/metrics' cache_config_info labels and kv_cache_capacity_tokens."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    [info] = families["pagedserve:cache_config_info"].samples
    [capacity] = families["pagedserve:kv_cache_capacity_tokens"].samples
    return info.labels, capacity.value


def test_health_and_metrics_open_by_default(keyed_server):
    assert httpx.get(keyed_server.url + "/health", timeout=30).status_code == 200
    metrics = httpx.get(keyed_server.url + "/metrics", timeout=30)
    assert metrics.status_code == 200 and "pagedserve:kv_blocks_total" in metrics.text
    labels, capacity = cache_config(metrics.text)
    assert labels["cache_dtype"] == "float32" and labels["block_size"] == "16"
    assert capacity == (int(labels["num_gpu_blocks"]) - 1) * 16  # all but the null block
    # ... but a wrong key on them is not an error either: they simply do not look.
    assert httpx.get(keyed_server.url + "/health", headers=bearer("nope"),
                     timeout=30).status_code == 200


def test_health_and_metrics_protected_when_configured(shared_server):
    for path in ("/health", "/metrics"):
        assert_error(httpx.get(shared_server.url + path, timeout=30), 401, "api key",
                     code="invalid_api_key")
        assert_error(httpx.get(shared_server.url + path, headers=bearer("k9"), timeout=30), 401,
                     code="invalid_api_key")
        for key in KEYS:
            assert httpx.get(shared_server.url + path, headers=bearer(key),
                             timeout=30).status_code == 200
    metrics = httpx.get(shared_server.url + "/metrics", headers=bearer(KEYS[0]), timeout=30)
    labels, capacity = cache_config(metrics.text)
    # The same 64 MiB as keyed_server's float32 cache: 3.56x the tokens at head_dim 16.
    assert labels["cache_dtype"] == "int8" and capacity > 3.5 * 64 * 2**20 / (2 * 2 * 2 * 16 * 4)
    # The API itself still needs a key too.
    assert_error(httpx.post(shared_server.url + CHAT, json={"messages": HELLO}, timeout=30), 401)


# -- tenant isolation of the prefix cache ------------------------------------------------
def long_prompt(seed: int, length: int = 150) -> list[int]:
    """A prompt no other test sends: nine full 16-token blocks and then some."""
    rng = random.Random(seed)
    return [rng.randrange(100, VOCAB) for _ in range(length)]


def cached_tokens(live: LiveServer, key: str, prompt, cache_salt: str | None = None) -> int:
    body = {"prompt": prompt, "max_tokens": 1}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    response = httpx.post(live.url + COMPLETIONS, json=body, headers=bearer(key), timeout=60)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_prefix_cache_is_private_to_each_key(keyed_server):
    prompt = long_prompt(1)
    assert cached_tokens(keyed_server, "k1", prompt) == 0
    again = cached_tokens(keyed_server, "k1", prompt)
    assert again >= 128, again  # k1 hits its own cache ...
    assert cached_tokens(keyed_server, "k2", prompt) == 0  # ... which k2 cannot see
    assert cached_tokens(keyed_server, "k2", prompt) >= 128  # k2 has its own now
    assert cached_tokens(keyed_server, "k1", prompt) >= 128  # and k1 still has its


def test_client_cache_salt_never_reaches_another_tenant(keyed_server):
    prompt = long_prompt(2)
    assert cached_tokens(keyed_server, "k1", prompt, cache_salt="team") == 0
    assert cached_tokens(keyed_server, "k1", prompt, cache_salt="team") >= 128
    # Whatever salt k2 sends (k1's, empty, k1's key, k1's tenant digest), k1's blocks stay out
    # of reach.
    k1_digest = hashlib.sha256(b"pagedserve-tenant\0k1").hexdigest()
    for salt in ("team", "", "k1", k1_digest, k1_digest + "\0team", "\0team"):
        assert cached_tokens(keyed_server, "k2", prompt, cache_salt=salt) == 0, salt
    # A client salt splits a tenant's own cache: k1 without it, or with another, misses.
    assert cached_tokens(keyed_server, "k1", prompt) == 0
    assert cached_tokens(keyed_server, "k1", prompt, cache_salt="other") == 0


def test_shared_prefix_cache_when_configured(shared_server):
    prompt = long_prompt(3)
    assert cached_tokens(shared_server, "k1", prompt) == 0
    assert cached_tokens(shared_server, "k2", prompt) >= 128  # k1's blocks, reused by k2
    # A client salt still splits the shared cache.
    assert cached_tokens(shared_server, "k2", prompt, cache_salt="mine") == 0
    assert cached_tokens(shared_server, "k1", prompt, cache_salt="mine") >= 128


# -- CORS ----------------------------------------------------------------------------------
def preflight(live: LiveServer, origin: str) -> httpx.Response:
    return httpx.options(live.url + CHAT, timeout=30, headers={
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    })


def test_cors_preflight_from_allowed_origin(keyed_server):
    response = preflight(keyed_server, ORIGIN)  # browsers send no key on a preflight
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in response.headers["access-control-allow-methods"]
    allowed = response.headers["access-control-allow-headers"].lower()
    assert "authorization" in allowed and "content-type" in allowed


def test_cors_preflight_from_other_origin_is_not_allowed(keyed_server):
    response = preflight(keyed_server, "http://evil.test")
    assert "access-control-allow-origin" not in response.headers
    assert response.status_code >= 400


def test_cors_headers_on_real_requests(keyed_server):
    ok = httpx.post(keyed_server.url + CHAT, timeout=60,
                    headers={"Origin": ORIGIN, **bearer("k2")},
                    json={"messages": HELLO, "max_tokens": 2})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    # The guard's 401 carries CORS headers too, so a page can read why it was refused.
    refused = httpx.post(keyed_server.url + CHAT, timeout=60, headers={"Origin": ORIGIN},
                         json={"messages": HELLO})
    assert_error(refused, 401, code="invalid_api_key")
    assert refused.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.post(keyed_server.url + CHAT, timeout=60,
                       headers={"Origin": "http://evil.test", **bearer("k2")},
                       json={"messages": HELLO, "max_tokens": 2})
    assert "access-control-allow-origin" not in other.headers


def test_no_cors_headers_without_an_allow_list(shared_server):
    response = preflight(shared_server, ORIGIN)
    assert "access-control-allow-origin" not in response.headers


def test_the_guards_own_refusals_are_counted_once_as_sent(keyed_server):
    """A missing key (401) and a body past the limit (413, by its length) are answered by
    the guard before any route: /metrics counts each answer the client got, once
    (from an address of its own, so no earlier refusal's pacing debt applies)."""
    def counts() -> Counter:
        text = httpx.get(f"{keyed_server.url}/metrics", timeout=30).text
        return Counter({(int(s.labels["status"]), s.labels["code"]): s.value
                        for family in text_string_to_metric_families(text)
                        for s in family.samples if s.name == "pagedserve:http_errors_total"})

    before = counts()
    transport = httpx.HTTPTransport(local_address="127.0.0.4")
    with httpx.Client(base_url=keyed_server.url, timeout=30, transport=transport) as http:
        answers = [http.post(COMPLETIONS, json={"prompt": "hi"}),
                   http.post(COMPLETIONS, content=b"x" * (10 << 20), headers=bearer("k1"))]
    seen = Counter((a.status_code, a.json()["error"]["code"]) for a in answers)
    assert [a.status_code for a in answers] == [401, 413], seen
    assert counts() - before == seen
