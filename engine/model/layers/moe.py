"""The mixture-of-experts block of Mixtral and Qwen3-MoE: a router and E gated
experts, their products through the kernel backend's ``fused_moe``::

    x [T, H] --gate [E, H]--> logits --softmax (fp32)--> top-k --(renormalise)--> weights [T, k], ids
    out = sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),   e = ids[t, j]
          w_gate_up [E, 2I, H] (rows: gate, then up),  w_down [E, H, I]

Routing exactly as HF transformers (5.x) computes it:
  * Mixtral (MixtralTopKRouter): softmax(logits.float()) -> topk -> divided by
    their sum, always; the weights stay float32.
  * Qwen3-MoE (Qwen3MoeTopKRouter): the same softmax and topk, divided by
    their sum only with ``norm_topk_prob``, then cast to the logits' dtype (the
    hidden dtype: bf16 weights in a bf16 model).

Checkpoint names (``load_expert_weight``), relative to the block (a full
name works too; Mixtral's checkpoints say ``block_sparse_moe.``, Qwen3-MoE's
and transformers 5's in-memory modules ``mlp.``):
  * router ``gate.weight`` [E, H];
  * per expert, what ``save_pretrained`` writes (transformers 4 and 5 both):
    Mixtral ``experts.{e}.w1/w3/w2.weight`` (gate / up / down), Qwen3-MoE
    ``experts.{e}.gate_proj/up_proj/down_proj.weight``;
  * fused, as transformers 5's modules hold them (their state_dict):
    ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I].

Tensor parallelism is refused for now: a ``group`` of more than one rank
raises ValueError (the experts are not split across ranks).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.model.layers.linear import Linear, packed
from kernels.moe import pack_experts

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")
_ROUTER = re.compile(r"(?:^|\.)gate\.weight$")
_PER_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"(?:^|\.)experts\.(gate_up_proj|down_proj)$")
# checkpoint projection -> (our tensor, shard: 0 = gate rows, 1 = up rows, None = whole)
_SHARDS = {"w1": ("w_gate_up", 0), "gate_proj": ("w_gate_up", 0), "w3": ("w_gate_up", 1),
           "up_proj": ("w_gate_up", 1), "w2": ("w_down", None), "down_proj": ("w_down", None)}


def is_moe_layer(hf_config, layer_index: int) -> bool:
    """Whether decoder layer ``layer_index`` has the MoE block (else a dense
    MLP of ``hf_config.intermediate_size``): every layer of Mixtral; for
    Qwen3-MoE HF's rule, not in ``mlp_only_layers`` and (i + 1) a multiple of
    ``decoder_sparse_step``."""
    if _model_type(hf_config) == "mixtral":
        return True
    return (layer_index not in (getattr(hf_config, "mlp_only_layers", None) or [])
            and hf_config.num_experts > 0
            and (layer_index + 1) % getattr(hf_config, "decoder_sparse_step", 1) == 0)


def _model_type(hf_config) -> str:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MOE_MODEL_TYPES:
        raise ValueError(f"no mixture-of-experts routing for model_type {model_type!r}; "
                         f"supported: {', '.join(MOE_MODEL_TYPES)}")
    return model_type


class FusedMoE(nn.Module):
    """Router ``gate`` (a Linear [E, H], no bias) and the experts' fused
    weights ``w_gate_up`` [E, 2I, H], ``w_down`` [E, H, I].  forward: [T, H] -> [T, H]
    (any leading shape).  ``renormalize``: divide the top-k probabilities by
    their sum; ``weights_in_input_dtype``: round them to x's dtype (Qwen3-MoE)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 kernels, *, renormalize: bool = True, weights_in_input_dtype: bool = False,
                 group=None) -> None:
        super().__init__()
        if group is not None and getattr(group, "size", 1) > 1:
            raise ValueError(
                f"mixture-of-experts layers do not support tensor parallelism yet "
                f"(tensor_parallel_size={group.size}); run this model with tensor_parallel_size=1")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.weights_in_input_dtype = renormalize, weights_in_input_dtype
        self.kernels = kernels
        self.gate = Linear(hidden_size, num_experts, False, kernels)
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                      requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size),
                                   requires_grad=False)
        self._loaded: set[str] = set()

    @classmethod
    def from_hf_config(cls, hf_config, kernels, group=None) -> "FusedMoE":
        """The block of a ``MixtralConfig`` or ``Qwen3MoeConfig`` (silu experts)."""
        model_type = _model_type(hf_config)
        if hf_config.hidden_act != "silu":
            raise ValueError(f"mixture-of-experts layers take hidden_act 'silu', got {hf_config.hidden_act!r}")
        if model_type == "mixtral":
            return cls(hf_config.hidden_size, hf_config.intermediate_size, hf_config.num_local_experts,
                       hf_config.num_experts_per_tok, kernels, group=group)
        return cls(hf_config.hidden_size, hf_config.moe_intermediate_size, hf_config.num_experts,
                   hf_config.num_experts_per_tok, kernels, renormalize=bool(hf_config.norm_topk_prob),
                   weights_in_input_dtype=True, group=group)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights float32 [T, k], topk_ids [T, k]) of x [T, H], as HF's router."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self.weights_in_input_dtype:
            weights = weights.to(x.dtype).float()
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.hidden_size)
        weights, ids = self.route(flat)
        out = self.kernels.fused_moe(flat, self.w_gate_up, self.w_down, weights, ids)
        return out.view(x.shape)

    # -- weights -------------------------------------------------------------------
    def load_expert_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy one checkpoint tensor (names in the module docstring) into the
        router or the fused expert weights; False if ``name`` is none of them."""
        if self.w_gate_up.dim() != 3:
            raise RuntimeError("load the expert weights before pack_weights()")
        if _ROUTER.search(name):
            return self._copy(name, self.gate.weight.data, tensor, "gate")
        fused = _FUSED.search(name)
        if fused:
            target = self.w_gate_up if fused.group(1) == "gate_up_proj" else self.w_down
            self._copy(name, target.data, tensor)
            for expert in range(self.num_experts):
                self._loaded.update(self._keys(fused.group(1), expert))
            return True
        match = _PER_EXPERT.search(name)
        if match is None:
            return False
        expert, (target, shard) = int(match.group(1)), _SHARDS[match.group(2)]
        if expert >= self.num_experts:
            raise ValueError(f"checkpoint tensor {name!r}: expert {expert} of {self.num_experts}")
        rows = getattr(self, target).data[expert]
        if shard is not None:
            width = self.intermediate_size
            rows = rows[shard * width:(shard + 1) * width]
        key = f"{target}.{expert}" + ("" if shard is None else f".{shard}")
        return self._copy(name, rows, tensor, key)

    def _copy(self, name: str, dest: torch.Tensor, tensor: torch.Tensor, key: str | None = None) -> bool:
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        if key is not None:
            self._loaded.add(key)
        return True

    @staticmethod
    def _keys(fused_name: str, expert: int) -> list[str]:
        if fused_name == "gate_up_proj":
            return [f"w_gate_up.{expert}.0", f"w_gate_up.{expert}.1"]
        return [f"w_down.{expert}"]

    def missing_weights(self) -> list[str]:
        """What ``load_expert_weight`` has not filled yet: "gate",
        "w_gate_up.{e}.{0 gate | 1 up}", "w_down.{e}" ([] when complete)."""
        wanted = ["gate"] + [key for expert in range(self.num_experts)
                             for fused in ("gate_up_proj", "down_proj")
                             for key in self._keys(fused, expert)]
        return [key for key in wanted if key not in self._loaded]

    def pack_weights(self) -> None:
        """The router and every expert's two weights into the layout the kernel
        backend multiplies fastest (kernels.pack_linear per expert, stacked:
        kernels.fused_moe's CPU path reads them); idempotent, unchanged where
        the backend has no packing."""
        self.gate.weight = packed(self.kernels, self.gate.weight)
        pack = self.kernels.pack_linear
        self.w_gate_up = nn.Parameter(pack_experts(self.w_gate_up.detach(), pack), requires_grad=False)
        self.w_down = nn.Parameter(pack_experts(self.w_down.detach(), pack), requires_grad=False)
