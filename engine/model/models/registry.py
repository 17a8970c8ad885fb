"""HF architecture name -> the model class that serves it.

A checkpoint names its architecture in config.json (`architectures`); one
that is not here, or that asks for something its class cannot honour, is
refused at start-up with what is missing, never loaded into a wrong model.
"""

from __future__ import annotations

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


def model_class(hf_config, tensor_parallel_size: int = 1) -> type[LlamaForCausalLM]:
    """The class for this config's architecture (a config without one is Llama's)."""
    architectures = getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"]
    architecture = architectures[0]
    cls = ARCHITECTURES.get(architecture)
    if cls is None:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    if tensor_parallel_size > 1 and not cls.TENSOR_PARALLEL:
        raise ValueError(f"{architecture}: tensor parallelism is not supported; "
                         f"use tensor_parallel_size=1")
    return cls
