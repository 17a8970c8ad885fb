"""What the engine must know of a model besides running it, and reading it from a checkpoint.

`load_model(config)` reads the checkpoint a config names and returns the
runner (weights and KV cache) with the ModelInfo beside it: vocabulary, EOS
ids, tokenizer, and the fingerprint that keys every prefix-cache block hash.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig
from engine.model.distributed.executor import TensorParallelRunner
from engine.model.kv_cache import dtype_name, token_capacity
from engine.model.model_runner import ModelRunner
from engine.model.models.registry import model_class
from engine.model.pooling.pooler import PoolingInfo
from engine.model.models.loader import (GGUF_LINK, load_hf_config, load_tokenizer,
                                        prepare_model_path_apart, resolve_model_path)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What the engine must know of a model besides running it.

    load_model() reads it from a checkpoint; an engine built around a given
    runner (LLMEngine(config, runner=..., model_info=...)) takes it as is.
    """

    vocab_size: int  # prompt token ids are checked against it
    eos_token_ids: frozenset[int] = frozenset()
    # Keys every prefix-cache block hash: equal fingerprints promise equal K/V.
    fingerprint: bytes = bytes(32)
    tokenizer: object | None = None  # None: prompts are token ids, outputs carry no text
    path: Path | None = None  # the checkpoint folder, when there is one
    # A pooling model's answers (engine/model/pooling/pooler.py); None: a generator.
    pooling: PoolingInfo | None = None


def load_model(config: EngineConfig) -> tuple[EngineConfig, ModelInfo, ModelRunner]:
    """Read the checkpoint that `config` names: the config with the model's own
    max_model_len filled in, what the engine must know of the model, and the
    runner holding its weights and KV cache."""
    model_path = resolve_model_path(config.model, config.cache_dir, dequantize(config))
    hf_config = load_hf_config(model_path)
    config = config.resolve_max_model_len(_position_limit(config, hf_config))
    tokenizer = (
        load_tokenizer(config.tokenizer, required=True)
        if config.tokenizer
        else load_tokenizer(model_path)
    )
    eos_token_ids = _eos_token_ids(hf_config, tokenizer)
    if config.tensor_parallel_size > 1:
        runner = TensorParallelRunner(config, hf_config, model_path, eos_token_ids)
    else:
        runner = ModelRunner(config, hf_config, model_path, eos_token_ids)
    pooling = runner.pooling if config.runner == "pooling" else None
    if pooling is not None and not pooling.prefix_cacheable:  # rows a hit would skip are pooled
        config = config.replace(enable_prefix_caching=False)
    info = ModelInfo(
        vocab_size=runner.model.args.vocab_size,
        eos_token_ids=eos_token_ids,
        fingerprint=model_fingerprint(model_path, runner.dtype, config),
        tokenizer=tokenizer,
        path=model_path,
        pooling=pooling,
    )
    logger.info(
        "model ready: %s on %s (%s); KV cache in %s: %d blocks of %d tokens, %d tokens in all",
        model_path.name, runner.device, dtype_name(runner.dtype),
        dtype_name(runner.kv_cache_dtype), runner.num_blocks, config.block_size,
        token_capacity(runner.num_blocks, config.block_size),
    )
    for rank, memory in enumerate(runner.memory_per_rank()):
        logger.info("rank %d of %d holds %.1f MiB of weights and %.1f MiB of KV cache",
                    rank, config.tensor_parallel_size, memory["weights_bytes"] / 2**20,
                    memory["kv_cache_bytes"] / 2**20)
    return config, info, runner


def dequantize(config: EngineConfig) -> bool:
    """Whether a GGUF file is served through its de-quantized folder (else as it is)."""
    return config.quantization != "gguf"


def prepare_model(config: EngineConfig) -> None:
    """What load_model would make on disk first (a GGUF file's folder), made in
    a child process: a server calls it before it loads (models/loader.py's
    prepare_model_path_apart says why)."""
    prepare_model_path_apart(config.model, config.cache_dir, dequantize(config))


def _position_limit(config: EngineConfig, hf_config) -> int:
    """The longest sequence the model's positions allow: its config's, except where
    a pooling family reads it its own way (XLM-R's positions start after padding_idx)."""
    if config.runner != "pooling":
        return hf_config.max_position_embeddings
    cls = model_class(hf_config, config.tensor_parallel_size, config.runner, config.convert)
    return cls.model_args(hf_config).max_position_embeddings


def model_fingerprint(model_path, dtype, config: EngineConfig) -> bytes:
    """What besides the tokens decides a block's K/V: weights, dtype, quantization,
    parallelism.

    The weights are named by their config and their files' names and sizes, so
    every replica that loads the same checkpoint agrees on it.
    """
    parts = [(model_path / "config.json").read_text()]
    parts += [f"{f.name}:{f.stat().st_size}" for f in sorted(model_path.glob("*.safetensors"))]
    if (model_path / GGUF_LINK).exists():  # a direct folder's name carries the file's digest
        parts.append(f"{model_path.name}:{(model_path / GGUF_LINK).stat().st_size}")
    parts += [str(dtype), f"quantization={config.quantization}", f"tp={config.tensor_parallel_size}"]
    if config.load_format == "dummy":  # random weights: equal only for equal seeds
        parts.append(f"dummy seed={config.seed}")
    return hashlib.sha256("\n".join(parts).encode()).digest()


def _eos_token_ids(hf_config, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (hf_config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
