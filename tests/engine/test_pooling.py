"""Pooling models offline (LLM.embed / score / classify) against sentence-transformers.

Tiny random checkpoints written by their owners' tools (tests/pooling_models.py):
a BERT embedder (mean pooling, normalised, bidirectional attention), a Qwen3
embedder (last-token pooling over causal attention, inputs rendered through the
chat template as sentence-transformers 6 declares for it), a BERT cross-encoder
(token types on the pair's second half; one label and three) and a Qwen3
sequence classifier. In float32 every vector and score must equal what
`SentenceTransformer.encode` and `CrossEncoder.predict` give, to 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, PoolingParams, SamplingParams
from engine.errors import ValidationError
from pooling_models import (make_bert_cross_encoder, make_bert_embedder, make_qwen3_classifier,
                            make_qwen3_embedder)

pytestmark = pytest.mark.usefixtures("single_thread")

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 3, "a",
         "what is the capital of france?", "paris is the capital city of france."]
PAIRS = [("what is the capital of france?", "paris is the capital city of france."),
         ("hello", "world"), ("the weather today", "sun and rain " * 4)]


def close(ours, theirs) -> None:
    torch.testing.assert_close(torch.as_tensor(ours, dtype=torch.float32),
                               torch.as_tensor(theirs, dtype=torch.float32),
                               rtol=1e-5, atol=2e-6)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("pooling")
    return {"bert": make_bert_embedder(root / "bert"),
            "qwen3": make_qwen3_embedder(root / "qwen3", smollm2_path),
            "cross": make_bert_cross_encoder(root / "cross"),
            "cross3": make_bert_cross_encoder(root / "cross3", num_labels=3),
            "qwen3-cls": make_qwen3_classifier(root / "qwen3-cls", smollm2_path)}


@pytest.fixture(scope="module")
def llms(folders):
    made: dict[str, LLM] = {}

    def get(name: str, **overrides) -> LLM:
        key = (name, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = LLM(str(folders[name]), runner="pooling", dtype="float32", **overrides)
        return made[key]
    return get


@pytest.mark.parametrize("name", ["bert", "qwen3"])
def test_embeddings_match_sentence_transformers(name, folders, llms):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folders[name]), device="cpu")
    ours = [o.outputs.embedding for o in llms(name).embed(TEXTS, use_tqdm=False)]
    close(ours, model.encode(TEXTS))
    query = [o.outputs.embedding for o in llms(name).embed(TEXTS[:2], use_tqdm=False,
                                                          prompt_name="query")]
    close(query, model.encode(TEXTS[:2], prompt_name="query"))


@pytest.mark.parametrize("name", ["cross", "qwen3-cls"])
def test_scores_match_cross_encoder(name, folders, llms):
    from sentence_transformers import CrossEncoder

    outputs = llms(name).score([a for a, _ in PAIRS], [b for _, b in PAIRS], use_tqdm=False)
    close([o.outputs.score for o in outputs], CrossEncoder(str(folders[name]),
                                                           device="cpu").predict(PAIRS))
    one_to_many = llms(name).score(PAIRS[0][0], [b for _, b in PAIRS], use_tqdm=False)
    expected = CrossEncoder(str(folders[name]), device="cpu").predict(
        [(PAIRS[0][0], b) for _, b in PAIRS])
    close([o.outputs.score for o in one_to_many], expected)


def test_classifier_probabilities_are_the_softmax_of_the_logits(folders, llms):
    from sentence_transformers import CrossEncoder

    llm = llms("cross3")
    assert llm.engine.pooling.labels == ("class_0", "class_1", "class_2")
    logits = CrossEncoder(str(folders["cross3"]), device="cpu").predict(PAIRS[:1])
    encoded = llm.get_tokenizer()(*PAIRS[0])
    llm.engine.add_request("pair", encoded["input_ids"], PoolingParams(use_activation=False),
                           token_type_ids=encoded["token_type_ids"])
    raw = [out for _ in range(3) for out in llm.engine.step()]
    assert [out.request_id for out in raw] == ["pair"]
    close(raw[0].outputs.data[None], logits)
    probs = llm.classify(TEXTS[:2], use_tqdm=False)
    assert all(abs(sum(o.outputs.probs) - 1) < 1e-5 for o in probs)


def test_a_batch_of_mixed_lengths_equals_one_at_a_time(llms):
    """64 inputs of 1..60 words in one batch (bidirectional attention over packed
    rows, one step) give the vectors each gives alone."""
    llm = llms("bert")
    words = "the quick brown fox jumps over the lazy dog and the cat".split()
    texts = [" ".join(words[j % len(words)] for j in range(1 + (i * 7) % 60)) for i in range(64)]
    together = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    alone = [llm.embed(text, use_tqdm=False)[0].outputs.embedding for text in texts[::7]]
    close([together[i] for i in range(0, 64, 7)], alone)


def test_prompts_are_never_split_across_steps(llms):
    """A step's budget smaller than the queue: every scheduled pooling prompt is whole."""
    llm = llms("bert", max_num_batched_tokens=64)
    seen = []
    execute = llm.engine.runner.execute

    def record(output):
        seen.extend((s.num_new_tokens, len(s.prompt_token_ids), s.start_position)
                    for s in output.sequences)
        return execute(output)
    llm.engine.runner.execute = record
    try:
        outputs = llm.embed(["the quick brown fox " * 4] * 9, use_tqdm=False)
    finally:
        llm.engine.runner.execute = execute
    assert len(outputs) == 9 and len(seen) == 9
    assert all(new == total and start == 0 for new, total, start in seen)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks - 1


def test_dimensions_truncate_then_normalise(llms):
    llm = llms("qwen3")
    full = llm.embed("hello world", PoolingParams(normalize=False), use_tqdm=False)[0]
    short = llm.embed("hello world", PoolingParams(dimensions=16), use_tqdm=False)[0]
    expected = torch.nn.functional.normalize(full.outputs.data[:16], dim=0)
    close(short.outputs.data, expected)
    with pytest.raises(ValidationError) as refused:
        llm.embed("hello", PoolingParams(dimensions=65), use_tqdm=False)
    assert refused.value.param == "dimensions"


def test_prefix_cache_only_where_the_pooled_row_is_computed_anyway(llms):
    """A bidirectional encoder (its K/V depend on later tokens) and mean pooling
    (every row is read) take no cache; last-token pooling over causal attention
    hits it and answers the same."""
    assert not llms("bert").engine.config.enable_prefix_caching
    llm = llms("qwen3")
    assert llm.engine.config.enable_prefix_caching
    text = "the quick brown fox jumps over the lazy dog " * 6
    first, again = (llm.embed(text, use_tqdm=False)[0] for _ in range(2))
    assert again.num_cached_tokens > 0
    close(again.outputs.data, first.outputs.data)


def test_long_inputs_are_refused_or_truncated(llms):
    llm = llms("bert")
    long_text = "the quick brown fox " * 200
    with pytest.raises(ValidationError) as refused:
        llm.embed(long_text, use_tqdm=False)
    assert refused.value.param == "prompt" and "truncate_prompt_tokens" in str(refused.value)
    out = llm.embed(long_text, use_tqdm=False, truncate_prompt_tokens=20)[0]
    assert len(out.prompt_token_ids) == 20


def test_one_kind_of_request_per_engine(llms, tiny_llama_path):
    with pytest.raises(ValidationError) as refused:
        llms("bert").generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    assert refused.value.param == "model"
    generator = LLM(str(tiny_llama_path), dtype="float32")
    with pytest.raises(ValidationError):
        generator.engine.add_request("x", [1, 2, 3], PoolingParams())
    with pytest.raises(ValidationError) as refused:
        llms("qwen3").engine.add_request("y", [1, 2], PoolingParams(), token_type_ids=[0, 1])
    assert refused.value.param == "token_type_ids"
    with pytest.raises(ValidationError) as refused:
        llms("cross").encode(["hi"], PoolingParams(task="embed"), use_tqdm=False)
    assert refused.value.param == "task"


def test_start_up_refusals(folders):
    with pytest.raises(ValueError, match="--runner pooling"):
        LLM(str(folders["bert"]), dtype="float32")
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(folders["bert"]), runner="pooling", enable_lora=True)
    with pytest.raises(ValueError, match="needs runner='pooling'"):
        LLM(str(folders["bert"]), convert="embed")
    with pytest.raises(ValueError, match="classify model already"):
        LLM(str(folders["cross"]), runner="pooling", convert="embed")


def test_a_generator_converted_to_an_embedder(tiny_llama_path):
    """--convert embed: the last token's final hidden state, normalised (HF's
    LlamaModel is the reference)."""
    from transformers import LlamaModel

    llm = LLM(str(tiny_llama_path), runner="pooling", convert="embed", dtype="float32")
    ids = [1, 5, 9, 200, 17]
    ours = llm.encode([ids], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.data
    hf = LlamaModel.from_pretrained(str(tiny_llama_path), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).last_hidden_state[0, -1]
    close(ours, expected)
