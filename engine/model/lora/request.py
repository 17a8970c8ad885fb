"""LoRARequest: which fine-tune a request runs under (vLLM's class and fields).

A LoRA adapter is a low-rank update of some of the base model's projections,
W x + B (A x) * scaling, stored as a PEFT folder (adapter_config.json +
adapter_model.safetensors). The base stays shared and unchanged: a step can
mix rows of the base and of several adapters (engine/model/lora/).

`lora_int_id` names the adapter inside the engine (it keys the host-memory
cache and the slots); `lora_name` is what clients see as `model`; the path is
where the engine reads it again after the cache let it go.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # >= 1; 0 is the base model (vLLM's convention)
    lora_path: str
    base_model_name: str | None = None  # the model the adapter was trained on, if given

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")
