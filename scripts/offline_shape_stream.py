"""Offline decode on a config-only (dummy-weight) model folder, pagedserve or vLLM.

    .venv/bin/python scripts/offline_shape_stream.py pagedserve --model FOLDER [--dtype bfloat16]
    VENV/bin/python scripts/offline_shape_stream.py vllm --model FOLDER [--dtype bfloat16]

BENCHMARK-ONLY (vLLM runs from its own venv, see scripts/vllm_cpu_peer.sh).
scripts/offline_one_stream.py with `--load-format` (default dummy: folders from
scripts/make_shape_folder.py hold no weights), the model length, the token
count and the repeats as flags, and an optional batch row:

- one stream: 128 prompt token ids, greedy, ignore_eos; ms per output token =
  (time for N tokens - time for 1 token) / (N - 1), fastest of --repeats each.
- --batch B: B such prompts (different ids) in one generate() call, --batch-tokens
  output tokens each: output tokens / wall seconds (prefill included), fastest
  of --batch-repeats.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from offline_one_stream import timed  # scripts/ is this script's folder


def pagedserve_generate(args):
    from engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, load_format=args.load_format,
              max_model_len=args.max_model_len, num_threads=args.num_threads)

    def generate(prompts: list[list[int]], tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(out.outputs[0].token_ids) == tokens for out in outs)

    return generate


def vllm_generate(args):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype=args.dtype, load_format=args.load_format,
              max_model_len=args.max_model_len, gpu_memory_utilization=args.vllm_memory)

    def generate(prompts: list[list[int]], tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)
        assert all(len(out.outputs[0].token_ids) == tokens for out in outs)

    return generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine", choices=("pagedserve", "vllm"))
    parser.add_argument("--model", required=True, help="model folder")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", type=int, default=0, help="also run B prompts at once")
    parser.add_argument("--batch-tokens", type=int, default=128)
    parser.add_argument("--batch-repeats", type=int, default=1)
    parser.add_argument("--vllm-memory", type=float, default=0.5,
                        help="vLLM's gpu_memory_utilization (its CPU KV budget)")
    parser.add_argument("--num-threads", type=int, default=0,
                        help="pagedserve's --num-threads (0: one per core)")
    parser.add_argument("--output", help="append one JSON line here")
    args = parser.parse_args()
    started = time.perf_counter()
    generate = (pagedserve_generate if args.engine == "pagedserve" else vllm_generate)(args)
    start_s = time.perf_counter() - started
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(128)]
    generate([prompt], 8)  # warm-up (compiles, first-touch allocations)
    one = timed(generate, [prompt], 1, args.repeats)
    many = timed(generate, [prompt], args.tokens, args.repeats)
    per_token = (many - one) / (args.tokens - 1)
    result = {"engine": args.engine, "model": args.model, "dtype": args.dtype,
              "start_s": round(start_s, 1), "ms_per_token": round(per_token * 1e3, 2),
              "one_token_ms": round(one * 1e3, 1), "tokens": args.tokens}
    print(f"{args.engine} ({args.dtype}) {args.model}: {per_token * 1e3:.1f} ms per output "
          f"token ({args.tokens} tokens: {many:.2f} s, 1 token: {one * 1e3:.0f} ms, best of "
          f"{args.repeats}; start {start_s:.0f} s)", flush=True)
    if args.batch:
        prompts = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(args.batch)]
        generate(prompts[:2], 2)
        seconds = timed(generate, prompts, args.batch_tokens, args.batch_repeats)
        rate = args.batch * args.batch_tokens / seconds
        result.update(batch=args.batch, batch_tokens=args.batch_tokens,
                      batch_s=round(seconds, 2), batch_tok_s=round(rate, 1))
        print(f"{args.engine} ({args.dtype}): {args.batch} x 128 in / {args.batch_tokens} out "
              f"in {seconds:.1f} s: {rate:.1f} output tok/s", flush=True)
    if args.output:
        with open(args.output, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
