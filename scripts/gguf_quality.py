"""What serving a GGUF quantized, or a quantized KV cache, costs in answers:
KL divergence and perplexity.

    python scripts/gguf_quality.py [--model smollm2-135m-instruct] [--text FILE]
                                   [--ctx 2048] [--windows 2] [--output quality.json]
                                   [--kv-cache-dtype int8]

Both sides are this engine on the same file:

    reference   --quantization none: the file de-quantized to float32 (HF's numbers)
    measured    --quantization gguf: the file's blocks in the compiled op, its
                activations quantized per 32 to 8 bits (K-quants' int8
                strips: per 256), bf16 between layers

With --kv-cache-dtype the weights are the same on both sides (float32) and
only the cache differs: the reference keeps float32 K/V, the measured side
stores them as the given dtype, and every position of the window attends
through the paged cache (the prompt's K/V are stored, then read back).

The text is cut into `--windows` windows of `--ctx` tokens, each one prompt,
and scored as llama.cpp's llama-perplexity scores a chunk: every position of
the window's second half predicts the next token, the first half is context.
So `perplexity` here and llama-perplexity's on the same file and text are the
same measure (the tokens may differ at window edges: llama-perplexity may put
a BOS in front of each chunk). KL is mean KL(reference || measured) over the
scored positions, in nats.

The full logits come from the model's own compute_logits, wrapped for the
run: the engine returns only top-k prompt logprobs, and 2,048 rows of 49,152
logprobs as Python dicts would be ~100 M entries.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"  # fixed, long, on every Debian machine


def window_logits(llm, windows: list[list[int]]) -> list[torch.Tensor]:
    """[ctx, vocab] float32 logits at every position of each window, in order."""
    from engine import SamplingParams

    model = llm.engine.runner.model
    captured: list[torch.Tensor] = []
    original = model.compute_logits

    def capture(hidden):
        logits = original(hidden)
        captured.append(logits.float().clone())
        return logits

    model.compute_logits = capture
    try:
        out = []
        for window in windows:
            captured.clear()
            params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
            llm.generate([{"prompt_token_ids": window}], params, use_tqdm=False)
            (logits,) = captured  # one step: the sampled row, then the prompt rows 0 .. n-2
            out.append(torch.cat([logits[1:], logits[:1]]))
        return out
    finally:
        model.compute_logits = original


def score(reference: list[torch.Tensor], measured: list[torch.Tensor], windows) -> dict:
    """KL and both perplexities over each window's second half."""
    kls, nll_ref, nll_new = [], [], []
    for ref, new, ids in zip(reference, measured, windows):
        half = len(ids) // 2
        rows = slice(half - 1, len(ids) - 1)  # position p predicts token p + 1
        targets = torch.tensor(ids[half:])
        lp_ref = torch.log_softmax(ref[rows], -1)
        lp_new = torch.log_softmax(new[rows], -1)
        kls.append((lp_ref.exp() * (lp_ref - lp_new)).sum(-1))
        nll_ref.append(-lp_ref.gather(1, targets[:, None]).squeeze(1))
        nll_new.append(-lp_new.gather(1, targets[:, None]).squeeze(1))
    kl, ref_nll, new_nll = (torch.cat(x) for x in (kls, nll_ref, nll_new))
    ppl_ref, ppl_new = math.exp(ref_nll.mean()), math.exp(new_nll.mean())
    return {"scored_tokens": kl.numel(), "mean_kl": kl.mean().item(),
            "p99_kl": kl.quantile(0.99).item(), "ppl_reference": ppl_ref,
            "ppl_quantized": ppl_new, "ppl_ratio": ppl_new / ppl_ref,
            "top1_agreement": sum((r.argmax(-1) == n.argmax(-1)).float().mean().item()
                                  for r, n in zip(reference, measured)) / len(reference)}


def main() -> None:
    from engine import LLM
    from engine.model.models.loader import load_tokenizer, resolve_model_path
    from engine.config import default_cache_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--text", default=DEFAULT_TEXT)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--kv-cache-dtype", default=None,
                        help="measure this KV-cache dtype against float32 K/V instead of the weights")
    args = parser.parse_args()

    tokenizer = load_tokenizer(resolve_model_path(args.model, default_cache_dir()), required=True)
    ids = tokenizer.encode(Path(args.text).read_text(), add_special_tokens=False)
    if len(ids) < args.ctx * args.windows:
        raise SystemExit(f"{args.text} has {len(ids)} tokens, fewer than {args.ctx} x {args.windows}")
    windows = [ids[i * args.ctx:(i + 1) * args.ctx] for i in range(args.windows)]
    common = dict(max_model_len=args.ctx + 8, max_num_batched_tokens=args.ctx + 8,
                  enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20)
    reference = window_logits(LLM(args.model, quantization="none", dtype="float32", **common),
                              windows)
    if args.kv_cache_dtype:
        measured_llm = LLM(args.model, quantization="none", dtype="float32",
                           kv_cache_dtype=args.kv_cache_dtype, **common)
    else:
        measured_llm = LLM(args.model, quantization="gguf", **common)
    measured = window_logits(measured_llm, windows)
    result = {"model": args.model, "text": args.text, "ctx": args.ctx, "windows": args.windows,
              "measured": f"kv_cache_dtype={args.kv_cache_dtype}" if args.kv_cache_dtype else "gguf",
              **score(reference, measured, windows)}
    print(json.dumps(result, indent=2))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
