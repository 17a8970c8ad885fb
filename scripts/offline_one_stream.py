"""One sequence decoded offline: milliseconds per output token, pagedserve or vLLM.

    .venv/bin/python scripts/offline_one_stream.py pagedserve [--dtype auto]
    VENV/bin/python scripts/offline_one_stream.py vllm --model FOLDER [--dtype bfloat16]

BENCHMARK-ONLY (vLLM runs from its own venv, see scripts/vllm_cpu_peer.sh).
Both engines get the same prompt token ids (128 of them), greedy decoding and
ignore_eos; the per-token time is (time for N tokens - time for 1 token) /
(N - 1), so the prefill and the request's fixed costs drop out. Each length
is run `--repeats` times and the fastest run counts.
"""

from __future__ import annotations

import argparse
import random
import time


def timed(generate, prompt: list[int], tokens: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        generate(prompt, tokens)
        best = min(best, time.perf_counter() - started)
    return best


def pagedserve_generate(args):
    from engine import LLM, SamplingParams

    llm = LLM(args.model or "smollm2-135m-instruct", dtype=args.dtype)

    def generate(prompt: list[int], tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == tokens

    return generate


def vllm_generate(args):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048,
              gpu_memory_utilization=0.5)

    def generate(prompt: list[int], tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == tokens

    return generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine", choices=("pagedserve", "vllm"))
    parser.add_argument("--model", help="model folder (vLLM: required)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    generate = (pagedserve_generate if args.engine == "pagedserve" else vllm_generate)(args)
    prompt = [random.Random(0).randrange(100, 40000) for _ in range(128)]
    generate(prompt, 8)  # warm-up (compiles, first-touch allocations)
    one = timed(generate, prompt, 1, args.repeats)
    many = timed(generate, prompt, args.tokens, args.repeats)
    per_token = (many - one) / (args.tokens - 1)
    print(f"{args.engine} ({args.dtype}): {per_token * 1e3:.1f} ms per output token "
          f"({args.tokens} tokens: {many:.2f} s, 1 token: {one * 1e3:.0f} ms, best of "
          f"{args.repeats})")


if __name__ == "__main__":
    main()
