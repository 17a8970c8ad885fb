"""Embeddings, scores, reranking and classification over HTTP (--runner pooling),
against sentence-transformers in float32 on the same tiny checkpoints
(tests/pooling_models.py): through the openai SDK (float and base64), /score,
/rerank and /classify; 64 concurrent requests equal to one at a time; and the
refusals, each naming its field."""

from __future__ import annotations

import asyncio
import base64
from contextlib import ExitStack

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoTokenizer

from engine.config import EngineConfig
from live_server import run_server, tiny_config
from pooling_models import (
    load_float32, make_bert_cross_encoder, make_bert_embedder, make_qwen3_classifier,
    make_qwen3_embedder,
)
from service.config import ServiceConfig

pytestmark = pytest.mark.usefixtures("single_thread")

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog",
         "what is the capital of france?", "paris is the capital city of france.",
         "rain today", "x"]
QUERY = "what is the capital of france?"
DOCUMENTS = ["berlin is the capital of germany.", "paris is the capital city of france.",
             "the weather today: sun, then rain.", "a quick brown fox", "paris"]
LONG = "the quick brown fox jumps over the lazy dog " * 40  # past 128 tokens


def close(ours, theirs) -> None:
    np.testing.assert_allclose(np.asarray(ours, dtype=np.float64),
                               np.asarray(theirs, dtype=np.float64), rtol=1e-5, atol=1e-6)


def pooling_config(folder, max_model_len: int) -> ServiceConfig:
    engine = EngineConfig(model=str(folder), runner="pooling", dtype="float32", seed=0,
                          max_model_len=max_model_len, kv_cache_memory_bytes=16 << 20)
    return ServiceConfig(engine=engine, served_model_name="pool")


MAKERS = {"bert": make_bert_embedder, "bert-ce": make_bert_cross_encoder,
          "bert-ce3": lambda folder: make_bert_cross_encoder(folder, num_labels=3)}
TOKENIZER_MAKERS = {"qwen3": make_qwen3_embedder, "qwen3-ce": make_qwen3_classifier}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm2_path):
    """name -> a tiny checkpoint folder, written when first asked for."""
    root, made = tmp_path_factory.mktemp("pooling-http"), {}

    def get(name: str):
        if name not in made:
            made[name] = (MAKERS[name](root / name) if name in MAKERS
                          else TOKENIZER_MAKERS[name](root / name, smollm2_path))
        return made[name]

    return get


@pytest.fixture(scope="module")
def servers(folders):
    """name -> a live pooling server on that checkpoint, started when first asked for
    (and all of them stopped at the module's end)."""
    started = {}
    with ExitStack() as stack:

        def get(name: str):
            if name not in started:
                config = pooling_config(folders(name), 256 if "qwen3" in name else 128)
                started[name] = stack.enter_context(run_server(config))
            return started[name]

        yield get


@pytest.fixture(scope="module")
def generator(tiny_llama_path):
    with run_server(tiny_config(tiny_llama_path)) as live:
        yield live


def sdk(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)


def post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json=body, timeout=120)


def sentence_transformer(folder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu")


def cross_encoder(folder):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(folder), device="cpu")


# -- embeddings ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bert", "qwen3"])
def test_embeddings_match_sentence_transformers(servers, folders, name):
    live = servers(name)
    expected = sentence_transformer(folders(name)).encode(TEXTS)
    answer = sdk(live).embeddings.create(model="pool", input=TEXTS, encoding_format="float")
    assert [d.index for d in answer.data] == list(range(len(TEXTS)))
    close([d.embedding for d in answer.data], expected)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > len(TEXTS)
    # The SDK's default asks for base64 and decodes it; asked for, it comes back as such.
    close([d.embedding for d in sdk(live).embeddings.create(model="pool", input=TEXTS).data],
          expected)
    raw = post(live, "/v1/embeddings", {"input": TEXTS[1], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    close(vector, expected[1])


def test_prompts_token_ids_and_dimensions(servers, folders):
    live, model = servers("bert"), sentence_transformer(folders("bert"))
    client = sdk(live)
    query = client.embeddings.create(model="pool", input=QUERY, extra_body={
        "prompt_name": "query"}).data[0].embedding
    close(query, model.encode(QUERY, prompt_name="query"))
    ids = model.tokenizer(TEXTS[1])["input_ids"]
    by_ids = client.embeddings.create(model="pool", input=ids).data[0].embedding
    close(by_ids, model.encode(TEXTS[1]))
    cut = client.embeddings.create(model="pool", input=TEXTS[1], dimensions=16).data[0].embedding
    full = model.encode(TEXTS[1])[:16]
    close(cut, full / np.linalg.norm(full))  # truncated, then normalised again
    raw = post(live, "/v1/embeddings", {"input": TEXTS[1], "normalize": False}).json()
    assert abs(np.linalg.norm(raw["data"][0]["embedding"]) - 1) > 1e-3


def test_truncation(servers, folders):
    live, model = servers("bert"), sentence_transformer(folders("bert"))
    refused = post(live, "/v1/embeddings", {"input": ["short", LONG]})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "input"
    cut = post(live, "/v1/embeddings", {"input": LONG, "truncate_prompt_tokens": -1}).json()
    close(cut["data"][0]["embedding"], model.encode(LONG))  # ST cuts at max_seq_length too
    assert cut["usage"]["prompt_tokens"] == 128
    assert post(live, "/v1/embeddings", {"input": LONG, "truncate_prompt_tokens": 10}).json()[
        "usage"]["prompt_tokens"] == 10
    ids = list(range(5, 205))
    assert post(live, "/v1/embeddings", {"input": ids}).status_code == 400
    assert post(live, "/v1/embeddings", {"input": ids, "truncate_prompt_tokens": 50}).json()[
        "usage"]["prompt_tokens"] == 50


@pytest.mark.parametrize("name", ["bert", "qwen3"])  # qwen3: cached prefixes stand in too
def test_concurrent_requests_equal_one_at_a_time(servers, name):
    live = servers(name)
    words = "the quick brown fox jumps over the lazy dog and the cat".split()
    texts = [" ".join(words[:1 + i % len(words)]) * (1 + i % 5) for i in range(64)]
    alone = [post(live, "/v1/embeddings", {"input": t}).json()["data"][0]["embedding"]
             for t in texts]

    async def together():
        async with httpx.AsyncClient(base_url=live.url, timeout=120) as client:
            answers = await asyncio.gather(*(client.post("/v1/embeddings", json={"input": t})
                                             for t in texts))
        return [a.json()["data"][0]["embedding"] for a in answers]

    close(asyncio.run(together()), alone)
    assert live.state.engine.num_open == 0


# -- scores, reranking, classification ------------------------------------------------------
@pytest.mark.parametrize("name", ["bert-ce", "qwen3-ce"])
def test_cross_encoder_scores_and_reranks_as_sentence_transformers(servers, folders, name):
    live = servers(name)
    expected = cross_encoder(folders(name)).predict([(QUERY, d) for d in DOCUMENTS])
    scored = post(live, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["index"] for d in scored["data"]] == list(range(len(DOCUMENTS)))
    close([d["score"] for d in scored["data"]], expected)
    pairwise = post(live, "/score", {"text_1": [QUERY] * 2, "text_2": DOCUMENTS[:2]}).json()
    close([d["score"] for d in pairwise["data"]], expected[:2])
    order = list(np.argsort(-expected, kind="stable"))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = post(live, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()
        assert [r["index"] for r in ranked["results"]] == order[:3]
        close([r["relevance_score"] for r in ranked["results"]], expected[order[:3]])
        assert [r["document"]["text"] for r in ranked["results"]] == [
            DOCUMENTS[i] for i in order[:3]]
        assert ranked["usage"]["prompt_tokens"] == scored["usage"]["prompt_tokens"]
    bare = post(live, "/rerank", {"query": QUERY, "documents": DOCUMENTS,
                                  "return_documents": False}).json()["results"]
    assert len(bare) == len(DOCUMENTS) and all("document" not in r for r in bare)


def test_an_embedding_models_scores_are_cosine_similarities(servers, folders):
    live, model = servers("bert"), sentence_transformer(folders("bert"))
    query, documents = model.encode(QUERY), model.encode(DOCUMENTS)
    expected = documents @ query  # normalised embeddings
    scored = post(live, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    close([d["score"] for d in scored["data"]], expected)
    ranked = post(live, "/rerank", {"query": QUERY, "documents": DOCUMENTS}).json()["results"]
    assert [r["index"] for r in ranked] == list(np.argsort(-expected, kind="stable"))


def test_classify_gives_label_probabilities(servers, folders):
    """One text each (CrossEncoder reads pairs): HF's own classifier is the reference."""
    live = servers("bert-ce3")
    tokenizer = AutoTokenizer.from_pretrained(str(folders("bert-ce3")))
    hf = load_float32(folders("bert-ce3"), "BertForSequenceClassification")
    with torch.no_grad():
        probs = hf(**tokenizer(TEXTS[:3], padding=True, return_tensors="pt")).logits.softmax(-1)
    answer = post(live, "/classify", {"input": TEXTS[:3]}).json()
    close([d["probs"] for d in answer["data"]], probs.numpy())
    assert [d["label"] for d in answer["data"]] == [f"class_{int(i)}" for i in probs.argmax(-1)]
    assert {d["num_classes"] for d in answer["data"]} == {3}
    pooled = post(live, "/pooling", {"input": TEXTS[:3]}).json()
    close([d["data"] for d in pooled["data"]], probs.numpy())


# -- what each server says it serves, and the refusals -------------------------------------
def test_models_say_what_the_server_serves(servers, generator):
    assert sdk(servers("bert")).models.list().data[0].task == "embed"
    assert sdk(servers("bert-ce")).models.list().data[0].task == "classify"
    assert sdk(generator).models.list().data[0].task == "generate"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": "x", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "dimensions": 65}, "dimensions"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": [[]]}, "input"),
    ("/v1/embeddings", {"input": [1, "x"]}, "input"),
    ("/v1/embeddings", {"input": [10 ** 6]}, "input"),
    ("/v1/embeddings", {"input": "x", "prompt_name": "nope"}, "prompt_name"),
    ("/v1/embeddings", {"input": [1, 2], "prompt_name": "query"}, "prompt_name"),
    ("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 129}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": "x", "temperature": 1}, "temperature"),
    ("/v1/embeddings", {"input": "x", "model": "other"}, "model"),
    ("/v1/embeddings", {"input": "x", "priority": 1}, "priority"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/score", {"text_1": "a", "text_2": ["b"], "use_activation": True}, "use_activation"),
    ("/rerank", {"query": "a", "documents": []}, "documents"),
    ("/rerank", {"query": "a", "documents": [LONG]}, "documents"),
    ("/pooling", {"input": "x", "task": "classify"}, "task"),
    ("/pooling", {"input": "x", "use_activation": True}, "use_activation"),
    ("/classify", {"input": "x"}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
])
def test_refusals_name_the_field(servers, path, body, param):
    response = post(servers("bert"), path, body)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param, response.text


def test_chat_on_a_pooling_server_and_embeddings_on_a_generator(servers, generator):
    with pytest.raises(openai.BadRequestError, match="this server runs a pooling model"):
        sdk(servers("bert")).chat.completions.create(
            model="pool", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="this server runs a generative model"):
        sdk(generator).embeddings.create(model="tiny", input="hi")
    for path in ("/score", "/rerank", "/classify", "/pooling"):
        assert post(generator, path, {}).status_code == 400
    classifier = post(servers("bert-ce"), "/v1/embeddings", {"input": "x"})
    assert classifier.status_code == 400 and "/classify" in classifier.json()["error"]["message"]
    several = post(servers("bert-ce3"), "/score", {"text_1": "a", "text_2": "b"})
    assert several.status_code == 400 and several.json()["error"]["param"] == "model"
