"""HF architecture name -> the model class that serves it.

A checkpoint names its architecture in config.json (`architectures`); one
that is not here, or that asks for something its class cannot honour, is
refused at start-up with what is missing, never loaded into a wrong model.
"""

from __future__ import annotations

from engine.model.models.bert import (BertForSequenceClassification, BertModel,
                                      XLMRobertaForSequenceClassification, XLMRobertaModel)
from engine.model.models.decoder_pooling import classifier_model, embedding_model
from engine.model.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from engine.model.models.llama import LlamaForCausalLM
from engine.model.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from engine.model.models.phi3 import Phi3ForCausalLM
from engine.model.models.qwen3 import Qwen3ForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}

# Encoders (models/bert.py): embedders and cross-encoders, pooling models only.
ENCODERS = {
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaModel": XLMRobertaModel,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
}


# A generator's dense families as pooling models (models/decoder_pooling.py), by the
# names their embedding and sequence-classification checkpoints give.
POOLING_BASES = {"Llama": LlamaForCausalLM, "Mistral": LlamaForCausalLM,
                 "Qwen2": LlamaForCausalLM, "Qwen3": Qwen3ForCausalLM}
POOLING_ARCHITECTURES = {
    **{f"{name}Model": embedding_model(cls) for name, cls in POOLING_BASES.items()},
    **{f"{name}ForSequenceClassification": classifier_model(cls)
       for name, cls in POOLING_BASES.items()},
    **ENCODERS,
}


def model_class(hf_config, tensor_parallel_size: int = 1, runner: str = "generate",
                convert: str | None = None) -> type[LlamaForCausalLM]:
    """The class for this config's architecture (a config without one is Llama's),
    as the runner serves it (EngineConfig.runner, .convert)."""
    architectures = getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"]
    architecture = architectures[0]
    if runner == "pooling":
        cls = _pooling_class(architecture, convert)
    else:
        cls = ARCHITECTURES.get(architecture)
        if cls is None and architecture in POOLING_ARCHITECTURES:
            raise ValueError(f"{architecture} is a pooling model (embeddings, scores): serve "
                             f"it with --runner pooling")
    if cls is None:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join([*ARCHITECTURES, *POOLING_ARCHITECTURES])}")
    if tensor_parallel_size > 1 and not cls.TENSOR_PARALLEL:
        raise ValueError(f"{architecture}: tensor parallelism is not supported; "
                         f"use tensor_parallel_size=1")
    return cls


def _pooling_class(architecture: str, convert: str | None):
    """A pooling checkpoint's class; a generator's converted (embed by default, as vLLM)."""
    cls = POOLING_ARCHITECTURES.get(architecture)
    if cls is not None:
        task = "classify" if hasattr(cls, "classify") else "embed"
        if convert not in (None, task):
            raise ValueError(f"convert={convert!r}: {architecture} is a {task} model already")
        return cls
    generator = ARCHITECTURES.get(architecture)
    if generator is None:
        return None
    family = architecture.removesuffix("ForCausalLM")
    name = f"{family}ForSequenceClassification" if convert == "classify" else f"{family}Model"
    return POOLING_ARCHITECTURES.get(name)
