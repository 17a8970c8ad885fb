"""Smoke test of `pagedserve bench embeddings`: one BERT-base-wide layer, a few
short texts, end to end to JSON. Timings are never asserted (shared CI machines
are noisy); the two systems' vectors must agree, as the benchmark checks."""

from __future__ import annotations

import json
import random

import pytest

from bench.offline import embeddings
from bench.offline.embedding_models import TEXT_WORDS, bert_tokenizer, build_embedder
from bench.offline.embedding_runs import sized_text

pytestmark = pytest.mark.usefixtures("single_thread")


def test_texts_have_the_asked_length(tmp_path):
    tokenizer = bert_tokenizer(tmp_path)
    rng = random.Random(0)
    for tokens in (1, 8, 32, 100):
        text = sized_text(tokenizer, rng, tokens, TEXT_WORDS)
        count = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert abs(count - tokens) <= 1, (tokens, count, text)


def test_model_folder_is_built_once(tmp_path):
    folder = build_embedder("bert", tmp_path, layers=1)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert build_embedder("bert", tmp_path, layers=1) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]) == (
        768, 30522, 1)


def test_bench_embeddings_writes_json(tmp_path):
    out = tmp_path / "embeddings.json"
    argv = ["--shapes", "bert", "--layers", "1", "--dtype", "float32", "--threads", "1",
            "--num-texts", "6", "--text-len", "4:24", "--query-len", "8", "--rounds", "2",
            "--repeats", "2", "--skip-vllm", "--work-dir", str(tmp_path / "models"),
            "--output", str(out)]
    assert embeddings.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "embeddings" and "avx512_bf16" in report["isa"]
    (case,) = report["cases"]
    assert case["shape"] == "bert" and case["dtype"] == "float32" and case["num_texts"] == 6
    assert case["systems"] == ["pagedserve", "sentence-transformers"]
    assert case["min_cosine"] > 0.999
    assert len(case["throughput_ratios"]) == 2 and len(case["latency_ratios"]) == 2
    for system in case["systems"]:
        assert case["throughput"][system]["embeddings_per_s"] > 0
        assert case["latency"][system]["p50_ms"] > 0
