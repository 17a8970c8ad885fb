"""Tiny random models written as GGUF files, the way llama.cpp's converter writes them.

`write_tiny_gguf` builds a family's tiny HF model exactly as tiny_models.py's
make_tiny_family does (same settings, same seed), then writes it with
gguf.GGUFWriter: the architecture's metadata keys (gguf.Keys), the first
TINY_VOCAB tokens of SmolLM2's tokenizer (and the merges that make them), the
tensors under llama.cpp's names (gguf.get_tensor_name_map) with the inverse of
the transforms transformers' GGUF loader undoes (Llama's q/k row permutation,
Gemma's norms stored as 1 + w).

2-D weights are stored in `tensor_type`: the legacy types are quantized from
the HF weights by gguf.quants; gguf cannot quantize the K types, so Q4_K, Q5_K
and Q6_K tensors are random valid blocks (finite fp16 scales) of the right
shape, and the reference numbers of such a file are its de-quantized values,
not the HF model's. "Q4_K_M" mixes types as llama.cpp's Q4_K_M does: attn_v,
ffn_down and token_embd in Q6_K, the other matrices in Q4_K. Norms, biases and
routers stay F32.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from tiny_models import build_tiny, family_settings

# write_tiny_gguf's families: FAMILIES entry, llama.cpp architecture, overrides.
# A GGUF has no key for Qwen2/3's partial sliding (use_sliding_window +
# max_window_layers) nor Qwen3-MoE's mlp_only_layers: llama.cpp's graphs for
# those architectures never slide and put experts on every layer, so the
# GGUF families are the tiny ones without them.
GGUF_FAMILIES = {
    "llama": ("mistral-sliding", "llama", dict(sliding_window=None)),
    "mistral": ("mistral-sliding", "llama", {}),
    "qwen2": ("qwen2-sliding", "qwen2",
              dict(use_sliding_window=False, sliding_window=None)),
    "qwen3": ("qwen3", "qwen3", {}),
    "phi3": ("phi3", "phi3", {}),
    # A GGUF has no key for query_pre_attn_scalar: llama.cpp scales by head_dim ** -0.5
    # (below 27B), so a file's tiny Gemma has the scalar equal to its head_dim.
    "gemma2": ("gemma2", "gemma2", dict(query_pre_attn_scalar=16)),
    "gemma3": ("gemma3", "gemma3", dict(query_pre_attn_scalar=16)),
    "mixtral": ("mixtral", "llama", {}),
    "qwen3-moe": ("qwen3-moe", "qwen3moe", dict(mlp_only_layers=[])),
}
# K blocks hold 256 values: every in_features a multiple of 256, head_dim 32.
K_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
               num_key_value_heads=4, head_dim=32)
K_FAMILY_SHAPE = {"gemma2": dict(query_pre_attn_scalar=32),
                  "gemma3": dict(query_pre_attn_scalar=32),
                  "qwen3-moe": dict(moe_intermediate_size=256)}


# Tokens a tiny file's vocabulary keeps: SmolLM2's first 4,096 and the 3,844
# merges that make them (its merge i makes token 252 + i, so they form a
# BPE of their own). Why: gguf's reader parses every token and merge of a
# file's metadata in Python, ~3.3 s for the whole 49,152, and the engine
# opens a file up to four times (its folder, its tokenizer, its tensors).
TINY_VOCAB = 4096


def tiny_settings(family: str, **shape) -> tuple[str, str, dict]:
    """(config class, model class, config fields) of a GGUF_FAMILIES entry's tiny model."""
    base, _, fixed = GGUF_FAMILIES[family]
    return family_settings(base, **{"vocab_size": TINY_VOCAB, **fixed, **shape})


def shape_for(family: str, tensor_type: str) -> dict:
    """Config overrides a file of this type needs: Q8_0 keeps the tiny shape,
    the others (K blocks of 256 among them) take K_SHAPE."""
    return {} if tensor_type == "Q8_0" else {**K_SHAPE, **K_FAMILY_SHAPE.get(family, {})}


LEGACY_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
MIXED = "Q4_K_M"
# Where a K block keeps its fp16 scales (d, dmin): byte offsets inside the block.
_K_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def write_tiny_gguf(path: Path, family: str, tokenizer_gguf: Path, tensor_type: str = "Q8_0",
                    seed: int = 1234, override_types: dict[str, str] | None = None,
                    **shape) -> Path:
    """Write `family` (a GGUF_FAMILIES key) as a GGUF file at `path`; `shape`
    overrides config fields as make_tiny_family's does. `override_types` forces
    the type of named GGUF tensors (raw random bytes of that type: for files a
    reader must refuse). Returns `path`."""
    import gguf

    arch = GGUF_FAMILIES[family][1]
    config_name, model_name, settings = tiny_settings(family, **shape)
    model = build_tiny(config_name, model_name, settings, seed)
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, arch, family, config)
    _copy_tokenizer(writer, tokenizer_gguf, config)
    rng = np.random.default_rng(seed)
    tensors = list(_gguf_tensors(model, arch))
    types = {name: _tensor_type(name, array, tensor_type) for name, array in tensors}
    types.update(override_types or {})
    file_type = {"Q4_K": "Q4_K_S", "Q5_K": "Q5_K_S"}.get(tensor_type, tensor_type)
    writer.add_file_type(int(gguf.LlamaFileType[f"MOSTLY_{file_type}"]))
    for name, array in tensors:
        data, qtype = _encode(array, types[name], rng)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_metadata(writer, arch: str, family: str, config) -> None:
    """The keys llama.cpp's convert_hf_to_gguf.py writes for these architectures."""
    import gguf

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_name(f"tiny-{family}")  # transformers reads "mistral" in it: a Mistral config
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    rope = _rope(config)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type", "default") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if getattr(config, "head_dim", None) is not None and arch != "llama":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if getattr(config, "sliding_window", None) and arch in ("llama", "phi3", "gemma2", "gemma3"):
        writer.add_sliding_window(config.sliding_window)
    if arch.startswith("gemma"):  # which layers slide (llama.cpp's default differs per version)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    if arch == "gemma3":
        writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)


def _rope(config) -> dict:
    """The global (full-attention) RoPE parameters of a transformers 5 config."""
    params = getattr(config, "rope_parameters", None) or {}
    if "full_attention" in params:
        params = params["full_attention"]
    return {"rope_theta": 10000.0, **params}


def _copy_tokenizer(writer, tokenizer_gguf: Path, config) -> None:
    """SmolLM2's tokenizer.* keys, with the tiny config's special ids."""
    import gguf

    special = {f"tokenizer.ggml.{key}_token_id": value
               for key, value in (("bos", config.bos_token_id), ("eos", config.eos_token_id),
                                  ("padding", getattr(config, "pad_token_id", None)))
               if isinstance(value, int)}
    for key, value, value_type, sub_type in _tokenizer_fields(Path(tokenizer_gguf)):
        if key not in special:
            writer.add_key_value(key, value, value_type, sub_type)
    for key, value in special.items():
        writer.add_key_value(key, value, gguf.GGUFValueType.UINT32)


@functools.lru_cache(maxsize=1)
def _tokenizer_fields(tokenizer_gguf: Path) -> tuple:
    """(key, value, type, array item type) of the file's tokenizer.* keys, its
    vocabulary cut to TINY_VOCAB tokens; read once per process (~3.3 s)."""
    import gguf

    keep = {"tokenizer.ggml.tokens": TINY_VOCAB, "tokenizer.ggml.token_type": TINY_VOCAB,
            "tokenizer.ggml.scores": TINY_VOCAB}
    fields, tokens = [], set()
    for key, field in gguf.GGUFReader(str(tokenizer_gguf)).fields.items():
        if key.startswith("tokenizer."):
            value = field.contents()
            if key in keep:
                value = value[:keep[key]]
            if key == "tokenizer.ggml.tokens":
                tokens = set(value)
            elif key == "tokenizer.ggml.merges":  # after the tokens in a llama.cpp file
                value = _merges_within(value, tokens)
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            fields.append((key, value, field.types[0], sub_type))
    return tuple(fields)


def _merges_within(merges: list[str], tokens: set[str]) -> list[str]:
    """The merges whose parts and product are all kept tokens (a prefix of the list)."""
    kept = []
    for merge in merges:
        left, right = merge.split(" ")
        if not {left, right, left + right} <= tokens:
            break
        kept.append(merge)
    return kept


def _gguf_tensors(model, arch: str):
    """(llama.cpp name, float32 numpy array in llama.cpp's layout) of every weight."""
    import gguf

    config = model.config
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and tied:
            continue  # llama.cpp writes no output.weight: the head is the embedding
        array = tensor.detach().float().numpy()
        if hf_name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            half = array.shape[1] // 2
            stem = names.get_name(hf_name.replace("gate_up_proj", "down_proj"))
            block = stem.removesuffix("ffn_down_exps")
            yield f"{block}ffn_gate_exps.weight", array[:, :half]
            yield f"{block}ffn_up_exps.weight", array[:, half:]
            continue
        if hf_name.endswith("experts.down_proj"):
            yield f"{names.get_name(hf_name)}.weight", array
            continue
        stem, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(stem)}.{suffix}"
        yield name, _inverse_transform(name, array, arch, config)


def _inverse_transform(name: str, array: np.ndarray, arch: str, config) -> np.ndarray:
    """What llama.cpp's converter does to a tensor that transformers' loader undoes."""
    if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
        heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
        # convert_hf_to_gguf.py LlamaModel.permute: rotary halves -> interleaved pairs
        return (array.reshape(heads, 2, array.shape[0] // heads // 2, *array.shape[1:])
                .swapaxes(1, 2).reshape(array.shape))
    if arch.startswith("gemma") and name.endswith("norm.weight"):
        return array + 1  # Gemma's RMSNorm multiplies by (1 + w); llama.cpp stores 1 + w
    return array


def _tensor_type(name: str, array: np.ndarray, tensor_type: str) -> str:
    """The type llama.cpp's quantizer would give this tensor."""
    if array.ndim < 2 or ".ffn_gate_inp." in name:
        return "F32"  # norms, biases, routers
    if tensor_type != MIXED:
        return tensor_type
    if name.startswith("token_embd.") or ".attn_v." in name or ".ffn_down" in name:
        return "Q6_K"
    return "Q4_K"


def _encode(array: np.ndarray, type_name: str, rng: np.random.Generator):
    """(data for GGUFWriter.add_tensor, its raw type or None for plain floats)."""
    import gguf

    if type_name in ("F32", "F16"):
        return array.astype(np.float32 if type_name == "F32" else np.float16), None
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "BF16" or type_name in LEGACY_TYPES:
        return gguf.quants.quantize(array.astype(np.float32), qtype), qtype
    return random_blocks(array.shape, qtype, rng), qtype


def random_blocks(shape: tuple[int, ...], qtype, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of a quantized tensor of `shape` (last axis: the row's values),
    with every fp16 scale set to a small finite value: valid blocks of any type."""
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block_size:
        raise ValueError(f"{qtype.name}: rows of {shape[-1]} values are not whole blocks of {block_size}")
    blocks = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block_size, type_size),
                          dtype=np.uint8)
    # Magnitudes near the tiny models' weights: the largest product of a
    # block's integer scale and quant is a few thousand.
    for offset in _K_SCALE_OFFSETS.get(qtype.name, (0,)):
        scales = rng.uniform(2e-5, 1e-4, size=blocks.shape[:-1]).astype(np.float16)
        blocks[..., offset:offset + 2] = scales.view(np.uint8).reshape(*scales.shape, 2)
    return blocks.reshape(*shape[:-1], -1)
