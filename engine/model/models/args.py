"""The numbers of an HF config a model needs, read and checked once.

One frozen `ModelArgs` serves every family: the fields are what the shared
layers read (engine/model/layers/), so a family that differs only in data
(which layers slide, how scores are scaled or capped) needs no code of its
own. Anything in a config that the layers cannot honour is refused here,
naming it, rather than loaded into a model that would give other tokens.

Sliding windows, as transformers decides them:

    config.layer_types         the truth where present (Qwen2/Qwen3: from
                               use_sliding_window + max_window_layers;
                               Gemma 2/3: alternating)
    else config.sliding_window every layer slides (Mistral, Phi-3)
"""

from __future__ import annotations

from dataclasses import dataclass

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class MoEArgs:
    """A mixture-of-experts family's routing (models/moe.py reads it from a config)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    layers: tuple[bool, ...]  # per layer: experts (True) or a dense MLP
    renormalize: bool  # the top-k probabilities divided by their sum
    weights_in_input_dtype: bool  # routing weights rounded to the hidden dtype (Qwen3-MoE)


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    hidden_act: str = "silu"
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    attn_scale: float = 0.0  # q.k multiplier; head_dim ** -0.5 unless the family says
    attn_soft_cap: float | None = None  # Gemma 2: cap * tanh(score / cap)
    final_soft_cap: float | None = None  # Gemma 2: the same on the logits
    moe: MoEArgs | None = None  # experts instead of the MLP on some layers

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple("full_attention" if w is None else "sliding_attention"
                     for w in self.sliding_windows)

    @classmethod
    def from_hf_config(cls, config, **family) -> "ModelArgs":
        """The config's numbers; `family` overrides what a family reads its own way."""
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_layers = config.num_hidden_layers
        attention_bias = bool(getattr(config, "attention_bias", False))
        fields = dict(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
            hidden_act=getattr(config, "hidden_act", "silu"),
            sliding_windows=sliding_windows(config, num_layers),
            attn_scale=head_dim**-0.5,
        )
        fields.update(family)
        return cls(**fields)


def sliding_windows(config, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's window (None: full attention), as HF's modeling code reads it."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return (window,) * num_layers
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}")
    if len(types) != num_layers:
        raise ValueError(f"layer_types names {len(types)} layers, the model has {num_layers}")
    if "sliding_attention" in types and not window:
        raise ValueError("layer_types has sliding layers but sliding_window is not set")
    return tuple(window if t == "sliding_attention" else None for t in types)
