"""Tiny random-weight Llamas saved as real HF folders (config.json + safetensors + tokenizer)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_model(folder: Path, tokenizer_source: Path, **overrides) -> Path:
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
    return save_tiny(folder, "LlamaConfig", "LlamaForCausalLM", settings, tokenizer_source, 1234)


def save_tiny(folder: Path, config_name: str, model_name: str, settings: dict,
              tokenizer_source: Path, seed: int) -> Path:
    """transformers' own model class with random weights, saved with a tokenizer."""
    from transformers import AutoTokenizer

    model = build_tiny(config_name, model_name, settings, seed)
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(tokenizer_source)).save_pretrained(folder)
    return folder



def keep_first_layers(source: Path, folder: Path, num_layers: int) -> Path:
    """A real checkpoint cut to its first `num_layers` decoder layers: the
    same weights, shapes, embedding, final norm and (tied) head, a fraction of
    the compute. For tests whose subject is the arithmetic path, not what the
    whole model says."""
    import json
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    assert num_layers < config["num_hidden_layers"], "keep fewer layers than the model has"
    config["num_hidden_layers"] = num_layers
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in sorted(source.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            kept = {name: f.get_tensor(name) for name in f.keys() if _layer_of(name) < num_layers}
        save_file(kept, str(folder / file.name), metadata={"format": "pt"})
    for file in source.iterdir():  # tokenizer, chat template, generation config
        if file.suffix != ".safetensors" and file.name != "config.json" and not file.name.startswith("gguf_"):
            shutil.copy(file, folder / file.name)
    return folder


def _layer_of(name: str) -> int:
    """The decoder layer a tensor belongs to (-1 for the embedding, norm, head)."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else -1

# A Hermes-style chat template (as Qwen2.5's, shortened): it shows the model its
# tools and writes earlier calls as <tool_call>{...}</tool_call>.
HERMES_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


# Tiny random checkpoints of every family the engine serves, built with
# transformers' own config and model classes. Windows of 20 tokens are shorter
# than most test prompts and not a multiple of any block size.
WINDOW = 20
_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
              initializer_range=0.3, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    "qwen3-sliding": ("Qwen3Config", "Qwen3ForCausalLM",
                      dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                           tie_word_embeddings=True)),
    "qwen2-sliding": ("Qwen2Config", "Qwen2ForCausalLM",
                      dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                           tie_word_embeddings=False)),
    "mistral-sliding": ("MistralConfig", "MistralForCausalLM",
                        dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(sliding_window=WINDOW, tie_word_embeddings=False, pad_token_id=0)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               # Every option away from its neighbour's value, so that one taken for
               # the other shows: the scale's scalar is not head_dim, and the caps
               # are small enough to bend the tiny model's scores and logits.
               dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                    num_hidden_layers=3,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    attn_logit_softcapping=2.0, final_logit_softcapping=5.0, pad_token_id=0,
                    initializer_range=0.1)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                    num_hidden_layers=3,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                        "rope_theta": 1000000.0}},
                    pad_token_id=0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                     tie_word_embeddings=False)),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                       head_dim=32, tie_word_embeddings=False)),
}


def make_tiny_family(folder: Path, family: str, tokenizer_source: Path, seed: int = 1234,
                     **shape) -> Path:
    """A tiny random checkpoint of `family` (a FAMILIES key), saved as an HF folder;
    `shape` overrides config fields (hidden_size=128: a head_dim of 32, which
    every build of the compiled CPU ops takes)."""
    config_name, model_name, settings = family_settings(family, **shape)
    return save_tiny(folder, config_name, model_name, settings, tokenizer_source, seed)


def family_settings(family: str, **shape) -> tuple[str, str, dict]:
    """(config class name, model class name, config fields) of a FAMILIES entry."""
    config_name, model_name, extra = FAMILIES[family]
    settings = {"vocab_size": 49152, "architectures": [model_name], **_SHAPE, **extra, **shape}
    return config_name, model_name, settings


def build_tiny(config_name: str, model_name: str, settings: dict, seed: int):
    """transformers' own model class with random weights (seeded), in memory."""
    import transformers

    torch.manual_seed(seed)
    return getattr(transformers, model_name)(getattr(transformers, config_name)(**settings))


# A Qwen3-style thinking template: the generation prompt opens the thought with
# "<think>\n" (as Qwen3's thinking templates do); with enable_thinking=false it
# writes an empty, closed thought instead, and the answer follows at once.
THINKING_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
THINK_TOKENS = ("<think>", "</think>")


def make_tiny_thinker(folder: Path, tokenizer_source: Path, seed: int = 1234) -> Path:
    """A tiny random Qwen3 that can think: `<think>` and `</think>` are tokens of
    its own (added, not special, as in Qwen3's tokenizer), with embedding and
    head rows for them, and its chat template is THINKING_CHAT_TEMPLATE."""
    import transformers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_source))
    tokenizer.add_tokens(list(THINK_TOKENS), special_tokens=False)
    tokenizer.chat_template = THINKING_CHAT_TEMPLATE
    _, model_name, extra = FAMILIES["qwen3"]
    config = transformers.Qwen3Config(vocab_size=len(tokenizer), architectures=[model_name],
                                      **{**_SHAPE, **extra})
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def teach_to_end_thought(folder: Path, prompt_ids: list[int], max_tokens: int = 24) -> list[int]:
    """Make greedy decoding of `prompt_ids` on the tiny thinker write `</think>`
    once, a few tokens in, with an answer after it; returns HF's greedy output ids.

    A random model never closes a thought by itself. Its greedy output is
    read with HF transformers; the head row of `</think>` becomes 1.5 times
    the row of the token it writes at step k, so wherever that token was the
    top logit (a positive one), `</think>` now is, by a margin. The first
    k from 2 whose new greedy output has exactly one `</think>` and at least
    three tokens after it (and no end-of-sequence) is saved into the checkpoint.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    end = AutoTokenizer.from_pretrained(str(folder)).convert_tokens_to_ids(THINK_TOKENS[1])
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    head = model.get_output_embeddings().weight

    def greedy() -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens,
                                 do_sample=False)
        return out[0, len(prompt_ids):].tolist()  # shorter: it wrote end-of-sequence

    plain, original = greedy(), head.data[end].clone()
    for k in range(2, min(len(plain), max_tokens - 4)):
        with torch.no_grad():
            head.data[end] = 1.5 * head.data[plain[k]]
        taught = greedy()
        if (len(taught) == max_tokens and taught.count(end) == 1
                and 2 <= taught.index(end) < max_tokens - 3):
            model.save_pretrained(folder, safe_serialization=True)
            return taught
        head.data[end] = original
    raise RuntimeError("no step of the greedy output could become </think>")


# A Mistral-style chat template (as Mistral-7B-Instruct-v0.3's, shortened): the tools in
# [AVAILABLE_TOOLS] before the last user turn, earlier calls as [TOOL_CALLS] [{...}], and, as
# the original, a refusal of any call id that is not 9 characters.
MISTRAL_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}{{ bos_token }}"
    "{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}"
    "[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "[INST] {{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] ["
    "{%- for c in m.tool_calls %}{%- if c.id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}{{ {'name': c.function.name, 'arguments': c.function.arguments, 'id': c.id}"
    " | tojson }}{{ ', ' if not loop.last }}{%- endfor %}]{{ eos_token }}"
    "{%- elif m.role == 'tool' %}{%- if m.tool_call_id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}[TOOL_RESULTS] {{ {'content': m.content, 'call_id': m.tool_call_id} | tojson }}"
    "[/TOOL_RESULTS]{%- else %} {{ m.content }}{{ eos_token }}{%- endif %}{%- endfor %}")
