"""A config-only model folder with a real model's shapes, for `--load-format dummy`.

    .venv/bin/python scripts/make_shape_folder.py NAME OUT_DIR
    NAME: qwen2-0.5b | llama-3.2-1b | qwen3-moe-small | gemma-3-1b | llama-3.1-8b | qwen3-8b (GPU)

BENCHMARK-ONLY. The folder holds config.json (the named model's shapes, written
by transformers' own config class so it loads as that architecture) and
SmolLM2-135M's tokenizer files, copied from pagedserve's converted SmolLM2
folder. No weights: pagedserve (`--load-format dummy`) and vLLM (the same flag)
fill them at random. SmolLM2's 49,152 token ids are all below every vocabulary
here, so prompts made with that tokenizer are valid ids for every shape; the
embedding and LM head keep the real model's vocabulary (the head's cost is the
real one). bos/eos are set to SmolLM2's ids (1 / 2) so the tokenizer and the
config agree; a benchmark decodes with ignore_eos anyway.

The copied tokenizer.json is padded to the model's vocabulary: ids 49152 and up
get BPE vocabulary entries "[[ID]]" (plain ASCII, no merge produces them, so
encoding is SmolLM2's unchanged). Without them a random-weight model samples
ids the tokenizer cannot decode, those tokens stream as empty text, and a
streaming benchmark (`pagedserve bench serve`, which counts text chunks) sees
missing tokens, inflated ITL and "no tokens received" failures.

Shapes (from the models' published config.json files):
- qwen2-0.5b: Qwen2-0.5B(-Instruct) / Qwen2.5-0.5B: hidden 896, intermediate
  4864, 24 layers, 14 heads / 2 KV heads (head_dim 64), vocab 151936, tied,
  q/k/v bias, rope_theta 1e6, 32768 positions, rms eps 1e-6.
- llama-3.2-1b: hidden 2048, intermediate 8192, 16 layers, 32 heads / 8 KV
  heads, head_dim 64, vocab 128256, tied, rope_theta 5e5 with llama3 scaling
  (factor 32, low 1, high 4, original 8192), 131072 positions, rms eps 1e-5.
- qwen3-moe-small: a Qwen3-MoE cut down to fit this 24 GiB machine (Qwen3-30B-A3B's
  per-layer shapes: hidden 2048, 32 heads / 4 KV heads, head_dim 128, experts of
  moe_intermediate 768, top-8, vocab 151936, untied head), with 64 experts and
  8 layers instead of 128 and 48: 3.19 B parameters (6.4 GB in bf16), 0.76 B
  active per token (0.31 B of it the LM head). Not larger because a dummy load
  builds the model in float32 before casting (peak ~12.8 GB here).
- gemma-3-1b: Gemma 3 1B (text): hidden 1152, intermediate 6912, 26 layers, 4
  heads / 1 KV head, head_dim 256, vocab 262144, tied; every sixth layer global,
  the others sliding over 512 tokens (local RoPE base 1e4, global 1e6),
  query_pre_attn_scalar 256, 32768 positions, rms eps 1e-6.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def smollm2_folder() -> Path:
    from engine.config import EngineConfig
    from engine.model.models.loader import resolve_model_path

    config = EngineConfig()
    return Path(resolve_model_path(config.model, config.cache_dir))


def make_config(name: str):
    common = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2, hidden_act="silu",
                  initializer_range=0.02, use_cache=True)
    if name == "qwen2-0.5b":
        from transformers import Qwen2Config

        return Qwen2Config(
            architectures=["Qwen2ForCausalLM"], hidden_size=896, intermediate_size=4864,
            num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
            vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
            rms_norm_eps=1e-6, rope_theta=1000000.0, use_sliding_window=False,
            sliding_window=32768, max_window_layers=24, attention_dropout=0.0,
            dtype="bfloat16", **common)
    if name == "llama-3.2-1b":
        return llama3(common, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      head_dim=64, tie_word_embeddings=True, factor=32.0)
    if name == "qwen3-moe-small":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144,
            num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960,
            rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False,
            use_sliding_window=False, output_router_logits=False, dtype="bfloat16", **common)
    if name == "gemma-3-1b":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(
            architectures=["Gemma3ForCausalLM"], hidden_size=1152, intermediate_size=6912,
            num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
            vocab_size=262144, tie_word_embeddings=True, max_position_embeddings=32768,
            rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=512,
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                         for i in range(26)],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
            hidden_activation="gelu_pytorch_tanh", dtype="bfloat16",
            **{k: v for k, v in common.items() if k != "hidden_act"})
    return make_gpu_config(name, common)


def llama3(common: dict, factor: float, **shape):
    """A Llama 3.x config: 32 heads / 8 KV heads, vocab 128256, llama3 RoPE scaling."""
    from transformers import LlamaConfig

    return LlamaConfig(
        architectures=["LlamaForCausalLM"], num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        attention_bias=False, mlp_bias=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        dtype="bfloat16", **shape, **common)


def make_gpu_config(name: str, common: dict):
    """The shapes `make gpu-bench` runs on one 80 GB GPU."""
    if name == "llama-3.1-8b":
        return llama3(common, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      head_dim=128, tie_word_embeddings=False, factor=8.0)
    if name == "qwen3-8b":
        from transformers import Qwen3Config

        return Qwen3Config(
            architectures=["Qwen3ForCausalLM"], hidden_size=4096, intermediate_size=12288,
            num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
            vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960,
            rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False,
            use_sliding_window=False, dtype="bfloat16", **common)
    raise SystemExit(f"unknown shape {name!r}: qwen2-0.5b | llama-3.2-1b | qwen3-moe-small | "
                     "gemma-3-1b | llama-3.1-8b | qwen3-8b")


def pad_tokenizer(path: Path, vocab_size: int) -> None:
    """Give every id below vocab_size a decodable BPE vocabulary entry."""
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    taken = set(vocab.values()) | {token["id"] for token in data.get("added_tokens", [])}
    for token_id in range(vocab_size):
        if token_id not in taken:
            vocab[f"[[{token_id}]]"] = token_id
    path.write_text(json.dumps(data, ensure_ascii=False))


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    name, out = sys.argv[1], Path(sys.argv[2])
    config = make_config(name)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    source = smollm2_folder()
    for file in TOKENIZER_FILES:
        if (source / file).exists():
            shutil.copy(source / file, out / file)
    pad_tokenizer(out / "tokenizer.json", config.vocab_size)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}, indent=2) + "\n")
    print(f"{name}: {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")


if __name__ == "__main__":
    main()
