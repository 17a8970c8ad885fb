"""Random-weight embedding models of real shapes, saved as sentence-transformers folders.

    folder = build_embedder("bert", work_dir)          # BERT-base: mean pooling + Normalize
    folder = build_embedder("qwen3", work_dir)         # Qwen3-Embedding-0.6B: last token
    folder = build_embedder("bert", work_dir, layers=2)   # --small: real widths, fewer layers

Written with their owners' tools (transformers' config and model classes,
save_pretrained, sentence-transformers' own modules), so the files are what a
user downloads; only the weights are random (seeded, float32). A folder is
built once and reused while its recorded shape matches (shape.json).

Tokenizers are built offline: BERT gets a small WordPiece vocabulary (BERT's
specials, every character whole and as a ## piece, a few whole words), padded
with [unusedN] entries to the model's 30,522 rows; the decoder gets SmolLM2's
tokenizer (the engine's default model) over Qwen3's 151,669-row table. The
Qwen3 Transformer module is pinned to the plain text modality, as Qwen3-Embedding
reads text (no chat template around it), so both systems tokenize the same way.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

SHAPES = {
    # name: (config class, model class, pooling mode, settings)
    "bert": ("BertConfig", "BertModel", "mean", dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        max_position_embeddings=512, vocab_size=30522, type_vocab_size=2, hidden_act="gelu",
        layer_norm_eps=1e-12, pad_token_id=0, architectures=["BertModel"])),
    "qwen3": ("Qwen3Config", "Qwen3Model", "lasttoken", dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, vocab_size=151669, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True, architectures=["Qwen3Model"])),
}
TITLES = {"bert": "BERT-base (110M)", "qwen3": "Qwen3-Embedding-0.6B"}
MAX_SEQ_LENGTH = {"bert": 512, "qwen3": 8192}

_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789") + list(".,;:!?'\"()-_/&%$#@*+=<>[]{}")
_WORDS = ("the a an of to in is it and or on for with as at by from this that what who "
          "how why when where which cat dog fox quick brown lazy jumps over query passage "
          "document hello world capital city paris france berlin germany weather today "
          "sun rain question answer good bad yes no").split()
# Plain English words the benchmark's texts are drawn from (bench/offline/embedding_runs.py).
TEXT_WORDS = _WORDS + ("model server engine batch token vector search index retrieval "
                       "memory cache layer attention network language sentence meaning "
                       "similar distance result ranking relevant compute matrix fast slow "
                       "people river mountain history science music").split()


def write_wordpiece_vocab(folder: Path, size: int = 0) -> Path:
    """vocab.txt of the small WordPiece vocabulary, padded with [unusedN] to `size` lines."""
    tokens = list(dict.fromkeys(_SPECIALS + _CHARS + ["##" + c for c in _CHARS] + _WORDS))
    tokens += [f"[unused{i}]" for i in range(max(0, size - len(tokens)))]
    path = Path(folder) / "vocab.txt"
    path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return path


def bert_tokenizer(folder: Path, size: int = 0, max_length: int = 512, **settings):
    """A lower-casing BertTokenizerFast over the small vocabulary, built in `folder`."""
    from transformers import BertTokenizerFast

    vocab = write_wordpiece_vocab(folder, size)
    return BertTokenizerFast(vocab=str(vocab), do_lower_case=True, model_max_length=max_length,
                             **settings)


def decoder_tokenizer(source: Path):
    """The source tokenizer (SmolLM2's), with a pad token for batches."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# The modality ST's Transformer infers for a text encoder; pinned for decoders whose
# tokenizer has a chat template, which ST 6 would otherwise render every input through.
TEXT_ONLY = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}


def save_sentence_transformer(folder: Path, hf_model, tokenizer, pooling_mode: str,
                              max_seq_length: int, text_only: bool = False) -> Path:
    """An ST folder: Transformer (the HF model) + Pooling(pooling_mode) + Normalize."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    with tempfile.TemporaryDirectory() as staging:
        hf_model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        pinned = dict(modality_config=TEXT_ONLY, module_output_name="token_embeddings")
        transformer = Transformer(staging, max_seq_length=max_seq_length,
                                  **(pinned if text_only else {}))
        pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling_mode)
        model = SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu")
        model.save(str(folder))
    return Path(folder)


def shape_settings(name: str, layers: int | None) -> dict:
    settings = dict(SHAPES[name][3])
    if layers:
        settings["num_hidden_layers"] = layers
        if name == "qwen3":
            settings["max_window_layers"] = layers
    return settings


def build_embedder(name: str, work_dir: Path, layers: int | None = None,
                   tokenizer_source: Path | None = None, seed: int = 0) -> Path:
    """The `name` shape's folder under work_dir: built once, then reused while
    its shape.json says the same shape and seed."""
    settings = shape_settings(name, layers)
    folder = Path(work_dir) / f"{name}-L{settings['num_hidden_layers']}"
    record = {"shape": name, "settings": settings, "seed": seed}
    marker = folder / "shape.json"
    if marker.is_file() and json.loads(marker.read_text()) == record:
        return folder
    staging = folder.with_name(folder.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    _write_folder(name, settings, staging, tokenizer_source, seed)
    (staging / "shape.json").write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return folder


def _write_folder(name: str, settings: dict, folder: Path, tokenizer_source: Path | None,
                  seed: int) -> None:
    import transformers

    config_name, model_name, pooling_mode, _ = SHAPES[name]
    with tempfile.TemporaryDirectory() as scratch:
        if name == "bert":
            tokenizer = bert_tokenizer(Path(scratch), settings["vocab_size"],
                                       settings["max_position_embeddings"])
        else:
            if tokenizer_source is None:
                raise ValueError("the decoder embedder needs a tokenizer folder")
            tokenizer = decoder_tokenizer(tokenizer_source)
            settings = dict(settings, pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id)
        torch.manual_seed(seed)
        config = getattr(transformers, config_name)(**settings)
        model = getattr(transformers, model_name)(config).eval()
        save_sentence_transformer(folder, model, tokenizer, pooling_mode, MAX_SEQ_LENGTH[name],
                                  text_only=name != "bert")
