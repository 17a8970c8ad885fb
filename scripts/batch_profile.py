"""Where a batch of streams spends its time, offline: the prefill alone, then
the whole run under torch's profiler (self time per op).

    .venv/bin/python scripts/batch_profile.py MODEL [--batch 32] [--prompt 128] [--tokens 64]

MODEL is anything `LLM` loads (a GGUF file, a folder). Prompts are random
token ids, greedy decoding, ignore_eos: the shape of `serve_workloads.sh
32-streams` without the server. Benchmark-only.
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens a stream")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens a stream")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from engine import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=2048, num_threads=args.threads)
    rng = random.Random(0)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(100, 30000) for _ in range(args.prompt)] for _ in range(args.batch)]

    def generate(batch: list[list[int]], tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        started = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - started

    generate(prompts()[:2], 4)  # warm-up: first-call costs out of the numbers
    prefill = generate(prompts(), 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        total = generate(prompts(), args.tokens)
    tokens = args.batch * args.prompt
    print(f"prefill {args.batch} x {args.prompt} tokens: {prefill:.2f} s ({tokens / prefill:.0f} tok/s); "
          f"with {args.tokens} output tokens each: {total:.2f} s "
          f"({args.batch * args.tokens / total:.1f} output tok/s)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
