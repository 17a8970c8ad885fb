"""A PEFT LoRA folder read and checked against the base model.

A PEFT adapter stores, for each projection it adapts, two matrices under the
base module's name:

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   [out, r]

and the projection computes W x + B (A x) * scaling, with scaling
lora_alpha / r (lora_alpha / sqrt(r) under rsLoRA). The matrices are kept
here by (layer, HF module name), with the scaling folded into A, in the
model's dtype; engine/model/lora/stacks.py puts them into the fused
projections' slots.

What is refused, naming the adapter_config.json field or the tensor: DoRA,
trained biases, modules saved whole (`modules_to_save`), per-module rank or
alpha patterns, fan-in/fan-out storage, an embedding or LM-head adapter, a
module this engine does not adapt, a rank above --max-lora-rank, and shapes
or layers that do not fit the base model (`base_model_name_or_path`).
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors

from engine.errors import ValidationError
from engine.model.lora.request import LoRARequest

# The projections an adapter may target: HF module name -> (our fused
# projection, which of its slices). Phi-3's checkpoints name the fused ones.
SLICES = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "qkv_proj": ("qkv_proj", None), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "gate_up_proj": ("gate_up_proj", None), "down_proj": ("down_proj", 0),
}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_FILES = ("adapter_model.safetensors",)


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    request: LoRARequest
    rank: int
    scaling: float
    digest: bytes  # SHA-256 of its two files: what it adds to a sequence's first block hash
    # (layer, HF module name) -> (A * scaling [r, in], B [out, r]), the model's dtype
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(request: LoRARequest, args, max_rank: int, dtype: torch.dtype,
                 partition=None) -> LoRAAdapter:
    """Read and check the adapter at request.lora_path for a model of ModelArgs
    `args`; with tensor parallelism, keep this rank's slice (`partition`)."""
    folder = Path(request.lora_path)
    config = _read_config(folder)
    _check_config(config, max_rank)
    scaling = config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)
    data = (folder / _FILES[0]).read_bytes()  # read once: its tensors and its digest
    tensors = load_tensors(data)
    pairs = _pairs(tensors)
    shapes = module_shapes(args)
    weights = {}
    for (layer, module), (a, b) in sorted(pairs.items()):
        _check_pair(layer, module, a, b, args, shapes, config)
        if partition is not None and partition.size > 1:
            a, b = _shard(partition, layer, module, a, b)
        weights[layer, module] = ((a.float() * scaling).to(dtype), b.to(dtype))
    if not weights:
        raise ValidationError(f"adapter {request.lora_name!r} holds no LoRA weights", "lora_path")
    digest = hashlib.sha256((folder / "adapter_config.json").read_bytes())
    digest.update(data)
    return LoRAAdapter(request, config.r, scaling, digest.digest(), weights)


def _read_config(folder: Path):
    from peft import LoraConfig  # the library that wrote it reads it: defaults, field names

    if not (folder / "adapter_config.json").is_file() or not (folder / _FILES[0]).is_file():
        raise ValidationError(f"{folder} is not a PEFT LoRA folder: it needs adapter_config.json "
                              f"and {_FILES[0]}", "lora_path")
    try:
        config = LoraConfig.from_pretrained(str(folder))
    except (ValueError, TypeError, OSError) as error:
        raise ValidationError(f"adapter_config.json: {error}", "lora_path") from None
    return config


def _check_config(config, max_rank: int) -> None:
    """Refuse what the kernels do not compute, naming the field."""
    problems = {
        "peft_type": str(getattr(config.peft_type, "value", config.peft_type)) != "LORA",
        "use_dora": bool(config.use_dora),
        "bias": config.bias != "none",
        "lora_bias": bool(getattr(config, "lora_bias", False)),
        "modules_to_save": bool(config.modules_to_save),
        "rank_pattern": bool(config.rank_pattern),
        "alpha_pattern": bool(config.alpha_pattern),
        "fan_in_fan_out": bool(config.fan_in_fan_out),
        "target_parameters": bool(getattr(config, "target_parameters", None)),
    }
    bad = [name for name, refused in problems.items() if refused]
    if bad:
        raise ValidationError(f"adapter_config.json: {bad[0]}={getattr(config, bad[0])!r} is not "
                              f"supported (plain LoRA and rsLoRA on linear projections are)",
                              "lora_path")
    if not 1 <= config.r <= max_rank:
        raise ValidationError(f"adapter_config.json: r={config.r} is above --max-lora-rank="
                              f"{max_rank}", "lora_path")


def _pairs(tensors: dict[str, torch.Tensor]) -> dict[tuple[int, str], list]:
    """(layer, module) -> [A, B] from the file's tensor names."""
    pairs: dict[tuple[int, str], list] = {}
    for name, tensor in tensors.items():
        match = _KEY.search(name)
        if match is None or match.group(2) not in SLICES:
            what = ("an embedding or LM-head adapter" if "embed" in name or "lm_head" in name
                    else "a module this engine does not adapt")
            raise ValidationError(f"adapter tensor {name!r} is {what}; supported target_modules: "
                                  f"{', '.join(SLICES)}", "lora_path")
        pair = pairs.setdefault((int(match.group(1)), match.group(2)), [None, None])
        pair[match.group(3) == "B"] = tensor
    for (layer, module), (a, b) in pairs.items():
        if a is None or b is None:
            raise ValidationError(f"layer {layer} {module}: lora_A and lora_B come in pairs",
                                  "lora_path")
    return pairs


def module_shapes(args) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each adaptable projection of the whole model."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    hidden, width = args.hidden_size, args.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "qkv_proj": (hidden, q + 2 * kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, width), "up_proj": (hidden, width),
            "gate_up_proj": (hidden, 2 * width), "down_proj": (width, hidden)}


def _check_pair(layer: int, module: str, a, b, args, shapes, config) -> None:
    where = f"layer {layer} {module}"
    if layer >= args.num_layers:
        raise ValidationError(f"{where}: the base model has {args.num_layers} layers "
                              f"(base_model_name_or_path={config.base_model_name_or_path!r})",
                              "lora_path")
    moe = args.moe is not None and args.moe.layers[layer]
    if moe and SLICES[module][0] in ("gate_up_proj", "down_proj"):
        raise ValidationError(f"{where}: that layer's MLP is a mixture of experts, which "
                              "adapters cannot target here", "lora_path")
    fan_in, fan_out = shapes[module]
    if tuple(a.shape) != (config.r, fan_in) or tuple(b.shape) != (fan_out, config.r):
        raise ValidationError(
            f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit this model "
            f"(expected ({config.r}, {fan_in}) / ({fan_out}, {config.r}); "
            f"base_model_name_or_path={config.base_model_name_or_path!r})", "lora_path")


def _shard(partition, layer: int, module: str, a: torch.Tensor, b: torch.Tensor):
    """This rank's part of a pair, cut as the base projection is
    (model/distributed/partition.py): a column-parallel projection keeps its
    output rows, so B's rows; a row-parallel one (o_proj, down_proj) its
    input columns, so A's columns. The other matrix stays whole: the ranks'
    partial updates add up in the all-reduce that closes the layer."""
    block = "mlp" if SLICES[module][0] in ("gate_up_proj", "down_proj") else "self_attn"
    name = f"model.layers.{layer}.{block}.{module}.weight"
    if module in ("o_proj", "down_proj"):
        return partition.shard_checkpoint_tensor(name, _Whole(a)), b
    return a, partition.shard_checkpoint_tensor(name, _Whole(b))


class _Whole:
    """A tensor in memory, read through the lazy-slice interface the partition cuts."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]
