"""Tiny random-weight Llamas saved as real HF folders (config.json + safetensors + tokenizer)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_model(folder: Path, tokenizer_source: Path, **overrides) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        # Large random weights give peaked next-token distributions, so greedy
        # decoding is decisive instead of a coin toss between near-equal logits.
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    settings.update(overrides)
    torch.manual_seed(1234)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(tokenizer_source)).save_pretrained(folder)
    return folder


# A Hermes-style chat template (as Qwen2.5's, shortened): it shows the model its
# tools and writes earlier calls as <tool_call>{...}</tool_call>.
HERMES_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
