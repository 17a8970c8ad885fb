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
from engine.model.models.loader import resolve_model_path
from need import need
from tiny_models import make_tiny_model


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
