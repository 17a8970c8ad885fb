"""LoRA adapters over HTTP, as vLLM serves them: `model` selects an adapter in
chat, completions and responses; /v1/models lists adapters with their parent;
/v1/load_lora_adapter and /v1/unload_lora_adapter behind the admin key.

One server on a tiny random Llama with three random PEFT adapters (written by
peft): two served from start-up (--lora-modules), one loaded at run time past
--max-cpu-loras 2, so the engine drops and re-reads adapters. Every expected
output is the offline engine's, computed before the server starts, with the
adapter passed as a LoRARequest (greedy, float32: batch-invariant).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.config import EngineConfig
from live_server import run_server, tiny_config
from lora_models import make_adapter, make_adapters
from service.config import LoRAModule, ServiceConfig
from tiny_models import make_tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")

API_KEY, ADMIN_KEY = "user-key", "admin-key"
NAMES = {"a": "qv-r4", "b": "all-r8-rs", "c": "mlp-r16"}  # served name -> lora_models.ADAPTERS
QUESTIONS = ["Hello there", "What is the capital of France?", "Name three colours."]
NEW_TOKENS = 12
LONG_TOKENS = 200  # a stream that is still running when its adapter is unloaded
ENGINE = dict(enable_lora=True, max_loras=2, max_cpu_loras=2, max_model_len=512)


def messages(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def case(tmp_path_factory, smollm2_path, single_thread):
    """(base folder, {served name: adapter folder}, expected texts)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("lora-http")
    base = make_tiny_model(root / "base", smollm2_path)
    folders = make_adapters(base, root)
    adapters = {name: folders[kind] for name, kind in NAMES.items()}
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(
        messages(q), tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        for q in QUESTIONS]
    return base, adapters, offline_texts(base, adapters, prompts)


def offline_texts(base, adapters: dict, prompts: list[list[int]]) -> dict:
    """{(adapter name or None, prompt index, max_tokens): text} from the offline engine."""
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=4)
    loras = {None: None, **{name: LoRARequest(name, i + 1, str(folder))
                            for i, (name, folder) in enumerate(adapters.items())}}
    items = [(name, i, n) for name in loras for i in range(len(prompts))
             for n in (NEW_TOKENS, LONG_TOKENS)]
    outputs = llm.generate(
        [{"prompt_token_ids": prompts[i]} for _, i, _ in items],
        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for *_, n in items],
        use_tqdm=False, lora_request=[loras[name] for name, *_ in items])
    return {item: output.outputs[0].text for item, output in zip(items, outputs)}


@pytest.fixture(scope="module")
def live(case):
    base, adapters, _ = case
    modules = tuple(LoRAModule.parse(f"{name}={adapters[name]}") for name in ("a", "b"))
    config = tiny_config(base, engine=ENGINE, api_keys=(API_KEY,), admin_keys=(ADMIN_KEY,),
                         allow_runtime_lora_updating=True, lora_modules=modules)
    with run_server(config) as server:
        yield server


def client(live, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0, timeout=120)


def post(live, path: str, body: dict, key: str | None = ADMIN_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(live.url + path, json=body, headers=headers, timeout=60)


def chat_text(live, model: str, question: str, max_tokens: int = NEW_TOKENS) -> str:
    answer = client(live).chat.completions.create(
        model=model, messages=messages(question), temperature=0, max_tokens=max_tokens,
        extra_body={"ignore_eos": True})
    assert answer.model == model  # answers name the adapter, as vLLM's do
    return answer.choices[0].message.content


# -- serving under an adapter -----------------------------------------------------------
@pytest.mark.parametrize("model", ["tiny", "a", "b"])
def test_chat_under_an_adapter_is_the_offline_engines(live, case, model):
    _, _, expected = case
    lora = None if model == "tiny" else model
    for i, question in enumerate(QUESTIONS):
        assert chat_text(live, model, question) == expected[lora, i, NEW_TOKENS], (model, i)


@pytest.mark.parametrize("name", ["a", "b", "c"])
def test_each_adapter_changes_some_answer(case, name):
    _, _, expected = case
    assert any(expected[name, i, NEW_TOKENS] != expected[None, i, NEW_TOKENS]
               for i in range(len(QUESTIONS))), f"adapter {name} changes nothing"


def test_completions_and_responses_pass_the_adapter(live, case):
    _, _, expected = case
    sdk = client(live)
    tokenized = post(live, "/tokenize", {"model": "b", "messages": messages(QUESTIONS[1]),
                                         "add_special_tokens": False}, key=API_KEY)
    assert tokenized.status_code == 200, tokenized.text  # an adapter's name: same tokenizer
    prompt = tokenized.json()["tokens"]
    completion = sdk.completions.create(model="b", prompt=prompt, temperature=0,
                                        max_tokens=NEW_TOKENS, extra_body={"ignore_eos": True})
    assert completion.model == "b"
    assert completion.choices[0].text == expected["b", 1, NEW_TOKENS]
    # The Responses API has no ignore_eos: an answer may stop early at EOS.
    response = sdk.responses.create(model="b", input=QUESTIONS[1], temperature=0,
                                    max_output_tokens=NEW_TOKENS)
    assert response.model == "b" and response.output_text
    assert expected["b", 1, NEW_TOKENS].startswith(response.output_text)
    if response.status == "incomplete":  # cut at max_output_tokens: the whole text
        assert response.output_text == expected["b", 1, NEW_TOKENS]


def test_render_names_the_adapter(live):
    rendered = post(live, "/v1/chat/completions/render",
                    {"model": "a", "messages": messages("hi")}, key=API_KEY)
    assert rendered.status_code == 200, rendered.text
    assert rendered.json()["model"] == "a"


def test_unknown_model_is_model_not_found(live):
    with pytest.raises(openai.NotFoundError) as caught:
        client(live).chat.completions.create(model="nope", messages=messages("hi"),
                                             max_tokens=2)
    assert caught.value.code == "model_not_found"
    assert caught.value.body["param"] == "model"
    for path, body in [("/v1/completions", {"model": "nope", "prompt": "hi"}),
                       ("/v1/responses", {"model": "nope", "input": "hi"}),
                       ("/tokenize", {"model": "nope", "prompt": "hi"})]:
        refused = post(live, path, body, key=API_KEY)
        assert refused.status_code == 404 and refused.json()["error"]["code"] == \
            "model_not_found", (path, refused.text)


# -- /v1/models ---------------------------------------------------------------------------
def test_models_lists_adapters_with_their_parent(live, case):
    _, adapters, _ = case
    cards = {m.id: m for m in client(live).models.list().data}
    assert {"tiny", "a", "b"} <= set(cards)
    assert getattr(cards["tiny"], "parent", None) is None
    for name in ("a", "b"):
        assert cards[name].parent == "tiny" and cards[name].root == str(adapters[name])
    one = client(live).models.retrieve("a")
    assert one.id == "a" and one.parent == "tiny"
    with pytest.raises(openai.NotFoundError):
        client(live).models.retrieve("nope")


# -- loading and unloading at run time ----------------------------------------------------
def test_load_needs_the_admin_key(live, case):
    _, adapters, _ = case
    body = {"lora_name": "c", "lora_path": str(adapters["c"])}
    assert post(live, "/v1/load_lora_adapter", body, key=None).status_code == 401
    assert post(live, "/v1/load_lora_adapter", body, key=API_KEY).status_code == 403
    assert post(live, "/v1/unload_lora_adapter", {"lora_name": "a"},
                key=API_KEY).status_code == 403
    assert "c" not in {m.id for m in client(live).models.list().data}


def test_load_then_serve_then_unload(live, case):
    _, adapters, expected = case
    loaded = post(live, "/v1/load_lora_adapter", {"lora_name": "c",
                                                  "lora_path": str(adapters["c"])})
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'c' added successfully."
    assert live.metrics()["pagedserve:lora_adapters_loaded"] == 3
    try:
        assert chat_text(live, "c", QUESTIONS[2]) == expected["c", 2, NEW_TOKENS]
        again = post(live, "/v1/load_lora_adapter", {"lora_name": "c",
                                                     "lora_path": str(adapters["c"])})
        assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    finally:
        unloaded = post(live, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.text == "Success: LoRA adapter 'c' removed successfully."
    assert live.metrics()["pagedserve:lora_adapters_loaded"] == 2
    with pytest.raises(openai.NotFoundError):
        chat_text(live, "c", QUESTIONS[2])


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/load_lora_adapter", {"lora_path": "/x"}, 400, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "/x"}, 400, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/folder"}, 400,
     "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": "/x"}, 400, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x", "rank": 8}, 400, "rank"),
    ("/v1/unload_lora_adapter", {}, 400, "lora_name"),
    ("/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "lora_name"),
    ("/v1/unload_lora_adapter", {"lora_name": "a", "lora_int_id": 99}, 400, "lora_int_id"),
])
def test_lora_route_refusals_name_the_field(live, path, body, status, param):
    refused = post(live, path, body)
    assert refused.status_code == status, refused.text
    assert refused.json()["error"]["param"] == param


def test_an_adapter_that_does_not_fit_is_refused_with_the_engines_reason(live, case, tmp_path):
    base, _, _ = case
    too_big = make_adapter(base, tmp_path / "r32", 3, r=32, lora_alpha=32,
                           target_modules=["q_proj"])
    refused = post(live, "/v1/load_lora_adapter", {"lora_name": "big",
                                                   "lora_path": str(too_big)})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "lora_path"
    assert "--max-lora-rank=16" in refused.json()["error"]["message"]
    assert "big" not in {m.id for m in client(live).models.list().data}


def test_unload_while_streaming_lets_the_stream_finish(live, case):
    """The engine defers the removal until the request under it ends; the
    stream's text is still the adapter's all the way (not the base's)."""
    _, adapters, expected = case
    assert post(live, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": str(
        adapters["b"])}).status_code == 200
    body = {"model": "d", "messages": messages(QUESTIONS[0]), "stream": True,
            "temperature": 0, "max_tokens": LONG_TOKENS, "ignore_eos": True}
    text, after_unload = "", 0
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as stream:
        lines = stream.iter_lines()
        unloaded = None
        for line in lines:
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                text += chunk["choices"][0]["delta"].get("content") or ""
            if unloaded is None and text:
                unloaded = post(live, "/v1/unload_lora_adapter", {"lora_name": "d"})
            elif unloaded is not None:
                after_unload += 1
    assert unloaded is not None and unloaded.status_code == 200, unloaded
    assert after_unload > 0, "the stream ended before the unload: nothing was in flight"
    assert text == expected["b", 0, LONG_TOKENS]
    with pytest.raises(openai.NotFoundError):
        chat_text(live, "d", QUESTIONS[0])


def test_adapters_past_max_cpu_loras_are_read_again_the_same(live, case):
    """Three adapters, two held: cycling through them drops and re-reads each."""
    _, adapters, expected = case
    assert post(live, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(
        adapters["c"])}).status_code == 200
    try:
        for name in ["a", "b", "c", "a", "c", "b"]:
            assert chat_text(live, name, QUESTIONS[1]) == expected[name, 1, NEW_TOKENS], name
        assert len(live.engine.runner.lora.cache) <= 2
    finally:
        assert post(live, "/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200


# -- configuration --------------------------------------------------------------------------
def test_runtime_routes_absent_without_the_flag(case):
    from starlette.testclient import TestClient

    from service.app import create_app

    base, _, _ = case
    app = create_app(tiny_config(base, engine=ENGINE))  # no lifespan: no engine is started
    paths = {getattr(route, "path", None) for route in app.routes}
    assert "/v1/load_lora_adapter" not in paths and "/v1/unload_lora_adapter" not in paths
    assert b"load_lora_adapter" not in app.state.openapi
    answer = TestClient(app).post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert answer.status_code == 404


def test_a_module_that_does_not_fit_stops_the_start_up(case, tmp_path):
    from service.app import start_service

    base, _, _ = case
    config = tiny_config(base, engine=ENGINE,
                         lora_modules=(LoRAModule("bad", str(tmp_path)),))
    with pytest.raises(ValueError, match=r"--lora-modules bad=.*not a PEFT LoRA folder"):
        asyncio.run(start_service(config))


def test_lora_flags(monkeypatch):
    from service.cli import build_parser, service_config_from_args

    def config(*argv):
        return service_config_from_args(build_parser().parse_args(["--dtype", "float32",
                                                                   *argv]))

    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        config("--lora-modules", "a=/x")
    with pytest.raises(ValueError, match="--allow-runtime-lora-updating needs --enable-lora"):
        config("--allow-runtime-lora-updating")
    parsed = config("--enable-lora", "--lora-modules", "a=/x",
                    '{"name": "b", "path": "/y", "base_model_name": "m"}',
                    "--lora-modules", "c=/z", "--served-model-name", "m")
    assert parsed.lora_modules == (LoRAModule("a", "/x"), LoRAModule("b", "/y", "m"),
                                   LoRAModule("c", "/z"))
    assert parsed.allow_runtime_lora_updating is False
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert config("--enable-lora").allow_runtime_lora_updating is True
    with pytest.raises(SystemExit):  # argparse: neither form
        config("--enable-lora", "--lora-modules", "just-a-name")
    with pytest.raises(ValueError, match="is given twice"):
        config("--enable-lora", "--lora-modules", "a=/x", "a=/y")
    with pytest.raises(ValueError, match="base_model_name 'other' is not the served model"):
        config("--enable-lora", "--lora-modules", '{"name": "a", "path": "/x", '
               '"base_model_name": "other"}')
    with pytest.raises(ValueError, match="needs --enable-lora"):
        ServiceConfig(engine=EngineConfig(), lora_modules=(LoRAModule("a", "/x"),))
