"""The BERT encoder family (engine/model/models/bert.py) against HF transformers.

The model is built and loaded as the runner does (the registry's class, the
checkpoint's tensors through load_weights) and driven over a real paged KV
cache with the runner's step encoding (encode_step / decode_step): sequences
of different lengths, across block boundaries, in one flat batch. Each
sequence's rows must be HF's last_hidden_state for it alone, in float32; the
classifiers' heads on the first rows must be HF's logits.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.sched_output import ScheduledSequence
from engine.model.kv_cache import KVLayout
from engine.model.models.loader import iter_checkpoint, load_hf_config
from engine.model.models.registry import model_class
from engine.model.pooling.token_types import carry
from engine.model.step_inputs import decode_step, encode_step
from kernels import get_backend
from pooling_models import load_float32, make_bert_cross_encoder, make_bert_embedder, make_xlm_roberta

BLOCK_SIZE = 16
LENGTHS = (7, 1, 40, 16, 23)  # one token, a whole block, several blocks


@pytest.fixture(scope="module", autouse=True)
def _one_thread(single_thread):
    yield


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> a tiny checkpoint folder (tests/pooling_models.py)."""
    root = tmp_path_factory.mktemp("encoders")
    return {
        "bert": make_bert_embedder(root / "bert"),
        "bert-ce": make_bert_cross_encoder(root / "bert-ce"),
        "bert-ce3": make_bert_cross_encoder(root / "bert-ce3", num_labels=3),
        "xlmr": make_xlm_roberta(root / "xlmr"),
        "xlmr-ce": make_xlm_roberta(root / "xlmr-ce", num_labels=1),
    }


def engine_model(folder, backend: str = "torch"):
    """The registry's class for the folder, loaded the runner's way, in float32."""
    hf_config = load_hf_config(folder)
    cls = model_class(hf_config, runner="pooling")
    model = cls(hf_config, cls.model_args(hf_config).max_position_embeddings, get_backend(backend))
    model.load_weights(iter_checkpoint(folder))
    model = model.to(torch.float32).eval()
    model.pack_linear_weights()
    return model


def run_prefill(model, sequences: list[list[int]]) -> torch.Tensor:
    """The model's hidden rows for whole sequences (ids, types carried), one step."""
    scheduled, next_block = [], 1  # block 0 is the null block
    for i, ids in enumerate(sequences):
        blocks = -(-len(ids) // BLOCK_SIZE)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        scheduled.append(ScheduledSequence(i, ids, 0, table, None, None, ids, []))
    header, payload = encode_step([], scheduled, [], [], BLOCK_SIZE)
    step = decode_step(header, payload)
    args = model.args
    cache = KVLayout(torch.float32, BLOCK_SIZE, args.num_kv_heads, args.head_dim).zeros(
        args.num_layers, next_block, "cpu")
    kv_cache = (tuple(cache[0]), tuple(cache[1]))
    with torch.no_grad():
        return model(step.input_ids, step.positions, kv_cache, step.meta)


def random_batch(vocab_size: int, seed: int, pairs: bool) -> tuple[list[list[int]], list[list[int]]]:
    """(token ids, token types) of sequences of LENGTHS: [CLS]-led, ids past the
    specials; with `pairs` each one's second part is type 1."""
    rng = random.Random(seed)
    ids, types = [], []
    for n in LENGTHS:
        ids.append([2] + [rng.randrange(5, vocab_size) for _ in range(n - 1)])
        cut = rng.randrange(1, n + 1) if pairs else n
        types.append([0] * cut + [1] * (n - cut))
    return ids, types


def rows_of(hidden: torch.Tensor) -> list[torch.Tensor]:
    return list(hidden.split(list(LENGTHS)))


def hf_rows(hf_model, ids, types) -> list[torch.Tensor]:
    """HF's output for each sequence alone (no padding): last_hidden_state or logits."""
    outputs = []
    with torch.no_grad():
        for seq, seq_types in zip(ids, types):
            kwargs = {"token_type_ids": torch.tensor([seq_types])} if seq_types else {}
            out = hf_model(input_ids=torch.tensor([seq]), **kwargs)
            outputs.append(out.logits[0] if hasattr(out, "logits") else out.last_hidden_state[0])
    return outputs


def assert_rows_close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=2e-5, msg=lambda m: f"sequence {i}: {m}")


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("pairs", [False, True])
def test_bert_hidden_states_match_hf(folders, backend, pairs):
    model = engine_model(folders["bert"], backend)
    hf = load_float32(folders["bert"], "BertModel")
    ids, types = random_batch(model.args.vocab_size, seed=1, pairs=pairs)
    hidden = run_prefill(model, [carry(s, t) for s, t in zip(ids, types)])
    assert hidden.shape == (sum(LENGTHS), model.args.hidden_size)
    assert_rows_close(rows_of(hidden), hf_rows(hf, ids, types))


@pytest.mark.parametrize("name,labels", [("bert-ce", 1), ("bert-ce3", 3)])
def test_bert_classifier_logits_match_hf(folders, name, labels):
    model = engine_model(folders[name])
    hf = load_float32(folders[name], "BertForSequenceClassification")
    assert model.num_labels == labels and model.labels == [hf.config.id2label[i] for i in range(labels)]
    ids, types = random_batch(model.args.vocab_size, seed=2, pairs=True)
    hidden = run_prefill(model, [carry(s, t) for s, t in zip(ids, types)])
    first_rows = torch.stack([rows[0] for rows in rows_of(hidden)])
    with torch.no_grad():
        logits = model.classify(first_rows)
    assert logits.shape == (len(LENGTHS), labels)
    assert_rows_close(list(logits), hf_rows(hf, ids, types))


def test_xlm_roberta_hidden_states_and_logits_match_hf(folders):
    model = engine_model(folders["xlmr"])
    ids, _ = random_batch(model.args.vocab_size, seed=3, pairs=False)
    no_types = [[] for _ in ids]
    expected = hf_rows(load_float32(folders["xlmr"], "XLMRobertaModel"), ids, no_types)
    assert_rows_close(rows_of(run_prefill(model, ids)), expected)
    classifier = engine_model(folders["xlmr-ce"])
    first_rows = torch.stack([rows[0] for rows in rows_of(run_prefill(classifier, ids))])
    with torch.no_grad():
        logits = classifier.classify(first_rows)
    hf = load_float32(folders["xlmr-ce"], "XLMRobertaForSequenceClassification")
    assert_rows_close(list(logits), hf_rows(hf, ids, no_types))


def test_the_model_reads_as_an_encoder(folders):
    """What the runner and the pooling engine key on: the family's flags, one KV
    head per head, the positions a prompt may use (XLM-R's after its padding row)."""
    bert = engine_model(folders["bert"])
    assert (bert.CAUSAL, bert.TENSOR_PARALLEL, bert.DEFAULT_POOLING) == (False, False, "CLS")
    assert bert.num_labels is None and bert.labels == [] and bert.token_types
    args = bert.args
    assert (args.num_kv_heads, args.head_dim, args.qkv_bias) == (args.num_heads, 16, True)
    assert args.sliding_windows == (None,) * args.num_layers
    assert args.max_position_embeddings == 128
    xlmr = engine_model(folders["xlmr"])
    assert xlmr.args.max_position_embeddings == 128 and not xlmr.token_types


def test_an_encoder_is_only_a_pooling_model(folders):
    hf_config = load_hf_config(folders["bert-ce"])
    assert model_class(hf_config, runner="pooling").__name__ == "BertForSequenceClassification"
    with pytest.raises(ValueError, match="--runner pooling"):
        model_class(hf_config)
    with pytest.raises(ValueError, match="classify model already"):
        model_class(hf_config, runner="pooling", convert="embed")


def test_unknown_and_missing_tensors_are_refused_by_name(folders):
    model = engine_model(folders["bert"])
    tensors = dict(iter_checkpoint(folders["bert"]))
    with pytest.raises(ValueError, match="cls.predictions.bias"):
        model.load_weights([*tensors.items(), ("cls.predictions.bias", torch.zeros(3))])
    del tensors["encoder.layer.1.output.LayerNorm.weight"]
    with pytest.raises(ValueError, match=r"layers\.1\.mlp_norm\.weight"):
        model.load_weights(tensors.items())
    # The pooler a BertModel checkpoint carries is not read; a classifier needs it.
    classifier = engine_model(folders["bert-ce"])
    tensors = {n: t for n, t in iter_checkpoint(folders["bert-ce"]) if "pooler" not in n}
    with pytest.raises(ValueError, match="pooler"):
        classifier.load_weights(tensors.items())


def test_a_longer_max_model_len_than_the_positions_is_refused(folders):
    hf_config = load_hf_config(folders["xlmr"])
    with pytest.raises(ValueError, match="128 positions"):
        model_class(hf_config, runner="pooling")(hf_config, 130, get_backend("torch"))
    with pytest.raises(ValueError, match="quantization"):
        engine_model(folders["bert"]).quantize_weights("Q8_0")
