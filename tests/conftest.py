"""Shared fixtures: the real SmolLM2 and a tiny random-weight Llama, both on disk.

Both are real HF folders (config.json + safetensors + tokenizer), loaded by the
same code path users take. The tiny model borrows SmolLM2's tokenizer so text
prompts work on it too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import DEFAULT_MODEL, default_cache_dir
from engine.models.loader import resolve_model_path
from need import need


@pytest.fixture(scope="module")
def single_thread():
    """One torch thread for a module, restored after it.

    The tiny model's ops are small; with two OpenMP threads on a busy 2-core
    machine each op waits on the other thread and a module runs ~10x slower.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    try:
        return resolve_model_path(DEFAULT_MODEL, default_cache_dir())
    except ValueError as exc:
        need(False, f"the default model is not available: {exc}")


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, smollm2_path) -> Path:
    """A 2-layer Llama with GQA (4 query heads, 2 KV heads) and random weights."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), smollm2_path)


def make_tiny_model(folder: Path, tokenizer_source: Path, **overrides) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        # Large random weights give peaked next-token distributions, so greedy
        # decoding is decisive instead of a coin toss between near-equal logits.
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    settings.update(overrides)
    torch.manual_seed(1234)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(tokenizer_source)).save_pretrained(folder)
    return folder
