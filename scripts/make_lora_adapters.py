"""Random LoRA adapters for a base checkpoint, written by peft (benchmarks).

    python scripts/make_lora_adapters.py OUT_DIR [--count 8] [--rank 16] [--model M]

OUT_DIR/lora0 ... lora{count-1}: PEFT folders on every projection (q, k, v,
o, gate, up, down) with random A and B (B non-zero, so the update is
computed, not skipped). `--model`: an HF folder, or the default model (the
SmolLM2 GGUF file's de-quantized folder, the same shapes the server serves).
Prints the `--lora-modules` flag value for `pagedserve serve`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from engine.config import DEFAULT_MODEL, default_cache_dir
from engine.model.models.loader import resolve_model_path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make(base: Path, out: Path, rank: int, seed: int) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                             init_lora_weights=False))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    model.save_pretrained(str(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    args = parser.parse_args()
    base = resolve_model_path(args.model, default_cache_dir())
    modules = []
    for i in range(args.count):
        folder = args.out / f"lora{i}"
        if not (folder / "adapter_config.json").is_file():
            make(base, folder, args.rank, seed=i)
        modules.append(f"lora{i}={folder}")
    print(" ".join(modules))


if __name__ == "__main__":
    main()
