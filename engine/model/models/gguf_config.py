"""A GGUF file's metadata as the HF config our model classes read.

The base is transformers' own mapping (load_gguf_checkpoint: GGUF_CONFIG_MAPPING
per architecture, its defaults and special cases), the config a GGUF-loaded
transformers model gets. That mapping drops keys llama.cpp writes and our
classes need, and then the config class's defaults stand in for them, right
only for the checkpoints the defaults came from. Completed here, from the
keys llama.cpp's converter writes (gguf.Keys):

    every family       architectures (the registry picks the class by it)
    llama + experts    Mixtral (llama.cpp writes Mixtral as llama with expert_count)
    llama, phi3        attention.sliding_window
    qwen3              attention.key_length -> head_dim (Qwen3Config's default is 128)
    qwen3moe           expert_feed_forward_length -> moe_intermediate_size
    gemma2/3           attention.sliding_window_pattern -> layer_types,
                       query_pre_attn_scalar (llama.cpp's rule, below)
    gemma2             attn/final logit softcapping
    gemma3             rope.scaling.* on the global layers, rope.freq_base_swa on the local ones

An architecture we do not serve is refused here, naming the ones we do.
"""

from __future__ import annotations

from pathlib import Path

# general.architecture values we serve (a llama file with experts is Mixtral).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3")
# llama.cpp scales Gemma's scores by (hidden / heads) ** -0.5 for the 27B
# models (as their HF configs' query_pre_attn_scalar does), by head_dim ** -0.5
# otherwise; it tells the 27B models by their layer count.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def hf_config_dict(path: Path, reader) -> dict:
    """transformers' config fields for this file, completed (see the module docstring)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    arch = _value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)} (mixtral as llama with experts)")
    config = load_gguf_checkpoint(str(path), return_tensors=False)["config"]

    def key(name: str):
        return _value(reader, f"{arch}.{name}")

    if arch == "llama" and key("expert_count"):
        config.update(model_type="mixtral", num_local_experts=key("expert_count"),
                      num_experts_per_tok=key("expert_used_count"))
    if arch in ("llama", "phi3") and key("attention.sliding_window"):
        config["sliding_window"] = key("attention.sliding_window")
    if arch in ("qwen3", "qwen3moe") and key("attention.key_length"):
        config["head_dim"] = key("attention.key_length")
    if arch == "qwen3moe" and key("expert_feed_forward_length"):
        config["moe_intermediate_size"] = key("expert_feed_forward_length")
    if arch.startswith("gemma"):
        _gemma(config, arch, key)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
    return config


def _gemma(config: dict, arch: str, key) -> None:
    layers = config["num_hidden_layers"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    wide = layers == _GEMMA_27B_LAYERS[arch]
    config["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"]
                                       if wide else head_dim)
    pattern = key("attention.sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0:
        # llama.cpp: layer i slides unless it is the last of each group of `pattern`
        pattern = [i % pattern < pattern - 1 for i in range(layers)]
    if isinstance(pattern, list) and len(pattern) == layers:
        config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
    if arch == "gemma2":
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if key(name) is not None:
                config[name] = key(name)
        return
    full = {"rope_type": "default", "rope_theta": config.pop("rope_theta", 1_000_000.0)}
    if key("rope.scaling.type") == "linear":
        full.update(rope_type="linear", factor=key("rope.scaling.factor"))
    local = {"rope_type": "default", "rope_theta": key("rope.freq_base_swa") or 10_000.0}
    config["rope_parameters"] = {"full_attention": full, "sliding_attention": local}


def make_config(config: dict):
    """The PretrainedConfig of these fields, as AutoConfig builds it for a GGUF file."""
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k != "model_type"}
    return AutoConfig.for_model(config["model_type"], **fields)


def _value(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()
