"""pagedserve's engine: paged KV cache, continuous batching, the offline LLM API."""

from engine.config import EngineConfig
from engine.frontend.llm import LLM
from engine.frontend.llm_engine import LLMEngine
from engine.model.lora.request import LoRARequest
from engine.model.pooling.params import PoolingParams
from engine.outputs import (CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput,
                            RequestOutputKind)
from engine.sampling_params import SamplingParams
from engine.sampling.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]
