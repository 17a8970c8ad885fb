"""Random LoRA adapters for tiny checkpoints, written by peft itself, and HF +
PEFT's greedy outputs under each (the reference the engine is held to)."""

from __future__ import annotations

from pathlib import Path

import torch

# name -> LoraConfig fields: ranks 4 / 8 / 16, different targets, rsLoRA on one.
ADAPTERS = {
    "qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-r8-rs": dict(r=8, lora_alpha=16, use_rslora=True,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj"]),
    "mlp-r16": dict(r=16, lora_alpha=16, target_modules=["o_proj", "gate_proj", "down_proj"]),
}
# Phi-3's checkpoints fuse the projections: its adapters name the fused modules.
FUSED_TARGETS = {"qv-r4": ["qkv_proj"], "all-r8-rs": ["qkv_proj", "o_proj", "gate_up_proj",
                                                      "down_proj"],
                 "mlp-r16": ["o_proj", "gate_up_proj"]}


def make_adapter(base_folder: Path, out: Path, seed: int, **fields) -> Path:
    """A PEFT folder for the checkpoint at `base_folder`: random A and random,
    non-zero B (init_lora_weights=False), scaled so the update shows."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_folder), dtype=torch.float32)
    config = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **fields)
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    model.save_pretrained(str(out))
    return out


def make_adapters(base_folder: Path, root: Path, fused: bool = False) -> dict[str, Path]:
    """Every ADAPTERS entry for one base checkpoint, in its own folder under `root`."""
    folders = {}
    for seed, (name, fields) in enumerate(ADAPTERS.items()):
        if fused:
            fields = {**fields, "target_modules": FUSED_TARGETS[name]}
        folders[name] = make_adapter(base_folder, root / name, seed + 7, **fields)
    return folders


def hf_peft_greedy(base_folder: Path, adapter: Path | None, prompts, num_tokens: int):
    """(token ids, top-k logprobs) per prompt from HF, with the adapter applied by PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_compare import _top_k

    model = AutoModelForCausalLM.from_pretrained(str(base_folder), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.generation_config.eos_token_id = None
    results = []
    for prompt in prompts:
        out = model.generate(
            input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=num_tokens, output_logits=True,
            return_dict_in_generate=True, pad_token_id=0)
        tops = [_top_k(torch.log_softmax(lg[0].float(), -1)) for lg in out.logits]
        results.append((out.sequences[0, len(prompt):].tolist(), tops))
    return results
