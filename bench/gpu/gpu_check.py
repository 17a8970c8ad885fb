"""End-to-end check of the Triton backend: the engine with Triton vs the torch reference vs HF.

    python -m bench.gpu.gpu_check --output e2e.json              (on a CUDA machine)
    TRITON_INTERPRET=1 python -m bench.gpu.gpu_check --device cpu --small   (anywhere, slowly)

It builds a random-weight Llama from a config (no downloads, no model
package), runs the same greedy prompts through

    1. HF transformers generate()            (the ground truth, float32)
    2. the engine with kernel_backend=torch  (the reference kernels)
    3. the engine with kernel_backend=triton (the kernels under test)

and compares token ids with vLLM's check_logprobs_close rule: identical until
the first mismatch, which must be a near-tie (each side's token in the other's
top-k). It also times the two engine runs. Exit status 0 when all agree.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from tests.hf_compare import TOP_K, compare, hf_greedy



def build_model(folder: Path, small: bool) -> Path:
    """A random Llama with GQA and head_dim 64 (a size every backend supports)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512 if small else 32000,
        hidden_size=128 if small else 1024,
        intermediate_size=256 if small else 2816,
        num_hidden_layers=2 if small else 8,
        num_attention_heads=4 if small else 16,
        num_key_value_heads=2 if small else 4,
        head_dim=64,
        max_position_embeddings=2048,
        initializer_range=0.3 if small else 0.05,  # peaked logits: decisive greedy choices
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def make_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def engine_greedy(folder: Path, prompts, warmup_prompts, num_tokens: int, backend: str,
                  device: str, dtype: str, block_size: int):
    """Greedy outputs plus (first-call seconds, warm seconds).

    Triton compiles each kernel specialisation on first use, so the first call
    times compilation as much as the kernels.  A second batch of different
    prompts with the same lengths (so no prefix-cache hits, same
    specialisations) gives the steady-state time.
    """
    from engine import LLM, SamplingParams

    # 2048 = the model's max_position_embeddings: room for the longest prompt
    # plus num_tokens, so no output is cut short by the length limit.
    llm = LLM(str(folder), kernel_backend=backend, device=device, dtype=dtype,
              block_size=block_size, max_model_len=2048, kv_cache_memory_bytes=1 << 28)
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True,
                            logprobs=TOP_K)
    timings = []
    for batch in (warmup_prompts, prompts):
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params,
                               use_tqdm=False)
        timings.append(time.perf_counter() - start)
    results = [(o.outputs[0].token_ids, [dict(t) for t in o.outputs[0].top_logprobs])
               for o in outputs]
    return results, timings


def run_check(device: str, small: bool, dtypes: list[str], block_sizes: list[int]) -> dict:
    lengths = [1, 5, 17, 40] if small else [1, 7, 33, 100, 250, 513, 1000, 64]
    num_tokens = 4 if small else 48
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp), small)
        from transformers import AutoConfig

        vocab_size = AutoConfig.from_pretrained(tmp).vocab_size
        prompts = make_prompts(vocab_size, lengths)
        warmup = make_prompts(vocab_size, lengths, seed=1)
        reference = hf_greedy(folder, prompts, num_tokens, device)
        report = {"device": _device_name(device), "torch": torch.__version__,
                  "prompt_lengths": lengths, "new_tokens": num_tokens, "runs": []}
        for dtype in dtypes:
            for block_size in block_sizes:
                torch_out, torch_s = engine_greedy(folder, prompts, warmup, num_tokens,
                                                   "torch", device, dtype, block_size)
                triton_out, triton_s = engine_greedy(folder, prompts, warmup, num_tokens,
                                                     "triton", device, dtype, block_size)
                run = {"dtype": dtype, "block_size": block_size,
                       "torch_first_seconds": torch_s[0], "torch_seconds": torch_s[1],
                       "triton_first_seconds": triton_s[0], "triton_seconds": triton_s[1],
                       "triton_vs_torch": compare(torch_out, triton_out)}
                if dtype == "float32":  # HF is the float32 ground truth
                    run["torch_vs_hf"] = compare(reference, torch_out)
                    run["triton_vs_hf"] = compare(reference, triton_out)
                report["runs"].append(run)
    report["ok"] = all(_passed(run) for run in report["runs"])
    return report


def _passed(run: dict) -> bool:
    """float32 must agree everywhere; in bf16/fp16 rounding legitimately diverges."""
    checks = [run[k] for k in ("torch_vs_hf", "triton_vs_hf") if k in run]
    if run["dtype"] == "float32":
        checks.append(run["triton_vs_torch"])
    return all(check["ok"] for check in checks)


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu (Triton interpreter)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny model, few tokens")
    parser.add_argument("--dtypes", default=None, help="comma-separated")
    parser.add_argument("--block-sizes", default=None, help="comma-separated")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    dtypes = (args.dtypes or ("float32" if args.small else "float32,bfloat16")).split(",")
    sizes = [int(b) for b in (args.block_sizes or ("16" if args.small else "16,128")).split(",")]
    report = run_check(args.device, args.small, dtypes, sizes)
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
