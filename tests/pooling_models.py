"""Tiny random-weight pooling checkpoints (embedders and cross-encoders), saved as real folders.

Each is written with its owners' tools: transformers' config and model classes
(save_pretrained) and sentence-transformers' own module classes, so the files
are what a user downloads. Weights are float32, seeded.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from bench.offline import embedding_models
from tiny_models import build_tiny

PROMPTS = {"query": "query: "}

_BERT_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=128, max_position_embeddings=128, hidden_act="gelu",
                   layer_norm_eps=1e-12, initializer_range=0.2, type_vocab_size=2,
                   pad_token_id=0)
_QWEN3_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.2,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def bert_tokenizer(folder: Path, **settings):
    """A lower-casing BertTokenizerFast over the benchmark's small WordPiece
    vocabulary (bench/offline/embedding_models.py), 128 tokens at most."""
    return embedding_models.bert_tokenizer(folder, max_length=128, **settings)


def save_sentence_transformer(folder: Path, hf_model, tokenizer, pooling_mode: str) -> Path:
    """An ST folder: Transformer (the HF model) + Pooling(pooling_mode) + Normalize,
    with PROMPTS and no default prompt."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    with tempfile.TemporaryDirectory() as staging:
        hf_model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        transformer = Transformer(staging)
        pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling_mode)
        model = SentenceTransformer(modules=[transformer, pooling, Normalize()],
                                    prompts=dict(PROMPTS), device="cpu")
        model.save(str(folder))
    return Path(folder)


def make_bert_embedder(folder: Path, seed: int = 4321) -> Path:
    """A tiny BertModel as a sentence-transformers folder: mean pooling, normalised."""
    folder = Path(folder)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = bert_tokenizer(Path(scratch))
        settings = dict(_BERT_SHAPE, vocab_size=len(tokenizer), architectures=["BertModel"])
        model = build_tiny("BertConfig", "BertModel", settings, seed)
        return save_sentence_transformer(folder, model, tokenizer, "mean")


def qwen3_tokenizer(tokenizer_source: Path):
    """The source tokenizer (SmolLM2's in tests), with a pad token for batches."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_source))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def make_qwen3_embedder(folder: Path, tokenizer_source: Path, seed: int = 4321) -> Path:
    """A tiny Qwen3Model as a sentence-transformers folder: last-token pooling, normalised."""
    tokenizer = qwen3_tokenizer(tokenizer_source)
    settings = dict(_QWEN3_SHAPE, vocab_size=len(tokenizer), architectures=["Qwen3Model"],
                    pad_token_id=tokenizer.pad_token_id)
    model = build_tiny("Qwen3Config", "Qwen3Model", settings, seed)
    return save_sentence_transformer(Path(folder), model, tokenizer, "lasttoken")


def make_bert_cross_encoder(folder: Path, num_labels: int = 1, seed: int = 4321) -> Path:
    """A tiny BertForSequenceClassification (a plain HF folder, as most rerankers
    ship) that sentence_transformers.CrossEncoder loads; num_labels=3 gives a
    classifier with named labels."""
    folder = Path(folder)
    labels = {0: "LABEL_0"} if num_labels == 1 else {i: f"class_{i}" for i in range(num_labels)}
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = bert_tokenizer(Path(scratch))
        settings = dict(_BERT_SHAPE, vocab_size=len(tokenizer), num_labels=num_labels,
                        id2label=labels, label2id={v: k for k, v in labels.items()},
                        architectures=["BertForSequenceClassification"])
        model = build_tiny("BertConfig", "BertForSequenceClassification", settings, seed)
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
    return folder


def make_qwen3_classifier(folder: Path, tokenizer_source: Path, seed: int = 4321) -> Path:
    """A tiny Qwen3ForSequenceClassification (one label, pad_token_id set: HF
    scores the last non-pad token), that CrossEncoder loads."""
    folder = Path(folder)
    tokenizer = qwen3_tokenizer(tokenizer_source)
    # Rerankers define their own input format; without a chat template CrossEncoder
    # reads the pair as the tokenizer's plain pair encoding, as the engine does.
    tokenizer.chat_template = None
    settings = dict(_QWEN3_SHAPE, vocab_size=len(tokenizer), num_labels=1,
                    pad_token_id=tokenizer.pad_token_id,
                    architectures=["Qwen3ForSequenceClassification"])
    model = build_tiny("Qwen3Config", "Qwen3ForSequenceClassification", settings, seed)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def make_xlm_roberta(folder: Path, num_labels: int | None = None, seed: int = 4321) -> Path:
    """A tiny XLM-RoBERTa: without num_labels an XLMRobertaModel as a
    sentence-transformers folder (CLS pooling, normalised), with it an
    XLMRobertaForSequenceClassification (a plain HF folder). One token type,
    positions from pad_token_id + 1 (the small WordPiece vocabulary's [PAD],
    0); the tokenizer returns no token_type_ids, as XLM-R's does."""
    folder = Path(folder)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = bert_tokenizer(Path(scratch), model_input_names=["input_ids", "attention_mask"])
        settings = dict(_BERT_SHAPE, vocab_size=len(tokenizer), type_vocab_size=1,
                        max_position_embeddings=129)  # 128 positions after the padding row
        if num_labels is None:
            settings["architectures"] = ["XLMRobertaModel"]
            model = build_tiny("XLMRobertaConfig", "XLMRobertaModel", settings, seed)
            return save_sentence_transformer(folder, model, tokenizer, "cls")
        name = "XLMRobertaForSequenceClassification"
        settings.update(num_labels=num_labels, architectures=[name])
        build_tiny("XLMRobertaConfig", name, settings, seed).save_pretrained(
            folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
    return folder


def load_float32(folder: Path, model_name: str):
    """transformers' `model_name` class loaded from `folder` in float32, eval mode
    (the reference the engine's output is compared against)."""
    import transformers

    model = getattr(transformers, model_name).from_pretrained(str(folder), dtype=torch.float32)
    return model.eval()
