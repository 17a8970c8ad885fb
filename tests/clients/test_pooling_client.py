"""The Python client's embed() and rerank() against a real pooling server (a tiny
BERT embedder, tests/pooling_models.py): vectors as sentence-transformers gives
them (base64 on the wire, decoded), the documents by relevance, errors typed."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from clients.python import AsyncClient, BadRequestError, Client
from engine.config import EngineConfig
from live_server import run_server
from pooling_models import make_bert_embedder
from service.config import ServiceConfig

pytestmark = pytest.mark.usefixtures("single_thread")

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "paris"]
QUERY = "what is the capital of france?"
DOCUMENTS = ["berlin is the capital of germany.", "paris is the capital city of france.",
             "the weather today: sun, then rain."]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_bert_embedder(tmp_path_factory.mktemp("client-pooling") / "bert")


@pytest.fixture(scope="module")
def server(folder):
    engine = EngineConfig(model=str(folder), runner="pooling", dtype="float32", seed=0,
                          max_model_len=128, kv_cache_memory_bytes=16 << 20)
    with run_server(ServiceConfig(engine=engine, served_model_name="emb",
                                  api_keys=("key",))) as live:
        yield live


@pytest.fixture(scope="module")
def expected(folder):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return {"texts": model.encode(TEXTS), "query": model.encode(QUERY),
            "documents": model.encode(DOCUMENTS)}


def close(ours, theirs) -> None:
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5, atol=1e-6)


def test_embed_and_rerank(server, expected):
    with Client(server.url, api_key="key") as client:
        answer = client.embed(TEXTS)
        close(answer.vectors, expected["texts"])
        assert answer.model == "emb" and answer.usage.prompt_tokens > len(TEXTS)
        close(client.embed(TEXTS, encoding_format="float").vectors, expected["texts"])
        close(client.embed(TEXTS[0], dimensions=8).vectors[0],
              expected["texts"][0][:8] / np.linalg.norm(expected["texts"][0][:8]))
        scores = expected["documents"] @ expected["query"]
        ranked = client.rerank(QUERY, DOCUMENTS, top_n=2)
        assert ranked.order == list(np.argsort(-scores))[:2]
        close([r.relevance_score for r in ranked.results], np.sort(scores)[::-1][:2])
        assert ranked.results[0].document.text == DOCUMENTS[ranked.order[0]]
        assert len(client.rerank(QUERY, DOCUMENTS).results) == len(DOCUMENTS)
        assert client.models()[0].task == "embed"


def test_the_async_client_says_the_same(server, expected):
    async def main():
        async with AsyncClient(server.url, api_key="key") as client:
            return (await client.embed(TEXTS),
                    await client.rerank(QUERY, DOCUMENTS, top_n=1, return_documents=False))

    answer, ranked = asyncio.run(main())
    close(answer.vectors, expected["texts"])
    scores = expected["documents"] @ expected["query"]
    assert ranked.order == [int(np.argmax(scores))] and ranked.results[0].document is None


def test_refusals_are_typed(server):
    with Client(server.url, api_key="key") as client:
        with pytest.raises(BadRequestError) as caught:
            client.embed(TEXTS, dimensions=0)
        assert caught.value.param == "dimensions"
        with pytest.raises(BadRequestError) as caught:
            client.chat([{"role": "user", "content": "hi"}])
        assert "pooling model" in caught.value.message
