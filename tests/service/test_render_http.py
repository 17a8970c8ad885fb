"""The render routes over HTTP: exactly the serving path's token ids (chat with and
without tools, completions in every prompt form), its errors, its auth, and the
tenant's tag; then vLLM's router routing a repeated prefix to the replica that
holds it, on the token ids these routes give it."""

from __future__ import annotations

import random
import re
import time

import httpx
import pytest

from live_server import free_port, run_server, tiny_config

pytestmark = pytest.mark.usefixtures("single_thread")

TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CHATS = [
    {"messages": [{"role": "user", "content": "Hello there"}]},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Weather in Paris?"}],
     "tools": TOOLS, "tool_choice": "required"},
    {"messages": [{"role": "user", "content": "Name a colour"}],
     "response_format": {"type": "json_schema", "json_schema": {
         "name": "c", "schema": {"type": "object", "properties": {"c": {"type": "string"}}}}}},
]


@pytest.fixture(scope="module")
def live(tiny_llama_path):
    with run_server(tiny_config(tiny_llama_path, api_keys=("key-a", "key-b"))) as server:
        yield server


def post(live, path, body, key="key-a"):
    return httpx.post(f"{live.url}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"})


@pytest.mark.parametrize("body", CHATS, ids=["plain", "tools", "schema"])
def test_chat_render_is_the_serving_paths_tokens(live, body):
    rendered = post(live, "/v1/chat/completions/render", {**body, "max_tokens": 3})
    assert rendered.status_code == 200, rendered.text
    generate = rendered.json()
    served = post(live, "/v1/chat/completions", {**body, "max_tokens": 3}).json()
    assert len(generate["token_ids"]) == served["usage"]["prompt_tokens"]
    assert generate["sampling_params"]["max_tokens"] == 3
    assert generate["model"] == "tiny" and generate["request_id"].startswith("chatcmpl")
    assert generate["cache_salt"].startswith("salt:")  # key-a's tenant, as its events say
    if "response_format" in body:
        assert "json" in generate["sampling_params"]["structured_outputs"]


def test_chat_render_equals_the_templates_own_tokens(live, tiny_llama_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_path))
    messages = CHATS[0]["messages"]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    generate = post(live, "/v1/chat/completions/render", {"messages": messages}).json()
    assert generate["token_ids"] == tokenizer.encode(text, add_special_tokens=False)


def test_completion_render_gives_one_request_per_prompt(live):
    prompts = ["one prompt", "and another, longer prompt"]
    rendered = post(live, "/v1/completions/render", {"prompt": prompts, "max_tokens": 2}).json()
    served = post(live, "/v1/completions", {"prompt": prompts[1], "max_tokens": 2}).json()
    assert [len(r["token_ids"]) for r in rendered][1] == served["usage"]["prompt_tokens"]
    assert len(rendered) == 2 and rendered[0]["request_id"] != rendered[1]["request_id"]
    ids = post(live, "/v1/completions/render", {"prompt": [5, 6, 7]}).json()
    assert [r["token_ids"] for r in ids] == [[5, 6, 7]]
    assert ids[0]["sampling_params"]["max_tokens"] == 16  # OpenAI's completions default


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "foo": 1},
     400, "foo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "model": "other"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 100_000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),  # 0: echo only
])
def test_render_refuses_what_serving_refuses(live, path, body, status, param):
    for route in (path, path + "/render"):
        response = post(live, route, body)
        assert response.status_code == status, (route, response.text)
        assert response.json()["error"]["param"] == param


def test_render_needs_a_key_and_names_each_tenant(live):
    body = {"messages": CHATS[0]["messages"]}
    assert httpx.post(f"{live.url}/v1/chat/completions/render", json=body).status_code == 401
    a = post(live, "/v1/chat/completions/render", body, "key-a").json()
    b = post(live, "/v1/chat/completions/render", body, "key-b").json()
    assert a["token_ids"] == b["token_ids"] and a["cache_salt"] != b["cache_salt"]


def test_kv_aware_router_sends_a_repeated_prefix_to_its_holder(tiny_llama_path, tmp_path):
    """Two replicas behind vllm-router --policy kv_aware. Each prompt is first
    sent to one replica directly (chats and completions, alternating replicas),
    then through the router: it must go to the replica holding its blocks (the
    router credits them, learning the tokens from the render routes), and be
    answered from that replica's prefix cache."""
    from router_process import RouterProcess

    configs = []
    for _ in range(2):
        events, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
        configs.append((events, replay, tiny_config(tiny_llama_path, engine={
            "kv_events_endpoint": events, "kv_events_replay_endpoint": replay})))
    with run_server(configs[0][2]) as one, run_server(configs[1][2]) as two:
        servers, port = [one, two], free_port()
        command = ["--host", "127.0.0.1", "--port", str(port),
                   "--worker-urls", one.url, two.url, "--policy", "kv_aware",
                   "--kv-event-model", "tiny", "--kv-event-block-size", "16",
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                   "--log-level", "debug"]
        for server, (events, replay, _) in zip(servers, configs):
            command += ["--kv-event-source", f"{server.url}={events}",
                        "--kv-event-replay-source", f"{server.url}={replay}"]
        router = RouterProcess(command, tmp_path / "router.log")
        try:
            router.wait_for(r"Router ready")
            _route_warmed_prompts(router, servers, f"http://127.0.0.1:{port}")
        finally:
            router.stop()


def _route_warmed_prompts(router, servers, router_url: str) -> None:
    rng = random.Random(7)
    words = "red green blue cat dog sun moon tree river stone cloud rain".split()
    for i in range(4):
        holder = servers[i % 2]
        if i < 2:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": " ".join(
                rng.choice(words) for _ in range(60))}]}
        else:
            path, body = "/v1/completions", {"prompt": [rng.randrange(3, 49152) for _ in range(70)]}
        body = {**body, "model": "tiny", "max_tokens": 1, "temperature": 0}
        first = httpx.post(holder.url + path, json=body, timeout=60).json()
        blocks = (first["usage"]["prompt_tokens"] - 1) // 16 * 16
        decisions = len(re.findall("KV request selected", router.text()))
        # the router has seen the holder's events for this prompt once it credits them
        deadline = time.monotonic() + 20
        while True:
            routed = httpx.post(router_url + path, json=body, timeout=60).json()
            chosen = re.findall(r"KV request selected .*?worker_url=\"([^\"]+)\".*", router.text())
            cached = routed["usage"]["prompt_tokens_details"]["cached_tokens"]
            if cached == blocks or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert cached == blocks, router.text()[-3000:]
        assert chosen[decisions:][-1] == holder.url
        credited = re.findall(r"credited_prefix_tokens=(\d+)", router.text())
        assert int(credited[-1]) == blocks


# What vllm-router 0.1.17 adds to the bodies it forwards (captured from the binary).
ROUTER_CHAT_EXTRAS = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False,
                      "continue_final_message": False, "skip_special_tokens": True,
                      "separate_reasoning": True, "stream_reasoning": True,
                      "return_hidden_states": False, "include_reasoning": True}
ROUTER_COMPLETION_EXTRAS = {"echo": False, "no_stop_trim": False, "ignore_eos": False,
                            "skip_special_tokens": True, "return_hidden_states": False}


def test_the_routers_added_fields_are_served_at_their_defaults_only(live):
    chat = {**CHATS[0], "max_tokens": 2, **ROUTER_CHAT_EXTRAS}
    completion = {"prompt": "hello", "max_tokens": 2, **ROUTER_COMPLETION_EXTRAS}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        for route in (path, path + "/render"):
            assert post(live, route, body).status_code == 200, route
    for name, value in (("return_hidden_states", True), ("continue_final_message", True),
                        ("include_reasoning", False), ("separate_reasoning", False)):
        refused = post(live, "/v1/chat/completions", {**chat, name: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == name
    kept = post(live, "/v1/completions", {"prompt": "one two three", "max_tokens": 6,
                                          "temperature": 0, "no_stop_trim": True,
                                          "stop": [" "]}).json()["choices"][0]
    if kept["finish_reason"] == "stop":  # the stop string stays in the text
        assert kept["text"].endswith(" ")


def test_a_pod_names_its_event_sources_as_the_router_asks(live, tiny_llama_path):
    """The shape vllm-router 0.1.17 reads in discovery mode (the fake pods of
    tests/deploy/test_router_helm.py answer the same and get subscribed to).
    /get_server_info is open; /kv_event_sources names the sockets that carry
    every tenant's prompt tokens, so once keys are set it takes one (a tenant's
    or an admin's, 401 without), unless --open-kv-event-sources (the chart's,
    for a router that holds no key)."""
    info = httpx.get(f"{live.url}/get_server_info")
    assert info.status_code == 200, info.text
    info = info.json()
    assert info["kv_block_size"] == 16 and info["instance_id"]
    assert httpx.get(f"{live.url}/kv_event_sources").status_code == 401
    assert get_key(live, "/kv_event_sources", "key-b").json() == {}  # publishes nothing
    for open_sources in (False, True):
        config = tiny_config(tiny_llama_path, api_keys=("k",), admin_keys=("adm",),
                             open_kv_event_sources=open_sources, engine={
                                 "kv_events_endpoint": f"tcp://127.0.0.1:{free_port()}",
                                 "kv_events_replay_endpoint": f"tcp://127.0.0.1:{free_port()}"})
        with run_server(config) as server:
            engine = config.engine
            expected = {"0": {"endpoint": engine.kv_events_endpoint,
                              "replay_endpoint": engine.kv_events_replay_endpoint,
                              "topic": "", "publisher": "zmq", "encoding": "msgpack",
                              "schema_version": 1}}
            keyless = httpx.get(f"{server.url}/kv_event_sources")
            wrong = get_key(server, "/kv_event_sources", "not-a-key")
            if open_sources:
                assert keyless.json() == wrong.json() == expected
            else:
                for refused in (keyless, wrong):
                    assert refused.status_code == 401, refused.text
                    assert refused.json()["error"]["code"] == "invalid_api_key"
                    assert "tcp://" not in refused.text
            for key in ("k", "adm"):
                assert get_key(server, "/kv_event_sources", key).json() == expected


def get_key(live, path, key):
    return httpx.get(f"{live.url}{path}", headers={"Authorization": f"Bearer {key}"},
                     timeout=30)
