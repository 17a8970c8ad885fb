"""Offline throughput: this engine vs HF `generate`, same workload, same process.

    pagedserve bench throughput [--num-prompts 64] [--output results.json]

The workload is random token prompts of mixed lengths with mixed output
lengths (ignore_eos, so every request produces exactly what it asked for).
HF runs it the best way static batching can: requests sorted by output
length, batches of each size in --hf-batch-sizes, left padding, and each
batch generating until its longest request is done; only the requested
tokens count. Both sides use greedy decoding, the same dtype and the same
threads, and are timed one after the other in this process, so the ratio is
meaningful even where absolute numbers are noisy.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from engine.cli import add_engine_args, config_from_args


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


@dataclass
class Result:
    system: str
    seconds: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    requests_per_s: float
    settings: str


def make_workload(num_prompts, input_range, output_range, vocab_size, seed) -> Workload:
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num_prompts):
        length = rng.randint(*input_range)
        # Skip the first ids: they are the special tokens of most vocabularies.
        prompts.append([rng.randrange(100, vocab_size) for _ in range(length)])
        outputs.append(rng.randint(*output_range))
    return Workload(prompts, outputs)


def run_engine(config, workload: Workload) -> Result:
    from engine import LLM, SamplingParams

    llm = LLM.from_config(config)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.num_output_tokens, (produced, workload.num_output_tokens)
    settings = f"block_size={config.block_size}, max_num_seqs={config.max_num_seqs}"
    return _result("pagedserve", seconds, workload, settings)


def run_hf(model_path: Path, dtype: torch.dtype, workload: Workload, batch_size: int) -> Result:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: every row runs to max_new_tokens
    order = sorted(range(len(workload.prompts)), key=lambda i: workload.output_lens[i])
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    _hf_batch(model, workload, batches[0][:2])  # warm-up
    start = time.perf_counter()
    for batch in tqdm(batches, desc=f"HF generate (batch {batch_size})", unit="batch"):
        _hf_batch(model, workload, batch)
    seconds = time.perf_counter() - start
    return _result("HF generate", seconds, workload, f"batch_size={batch_size}, sorted by length")


def _hf_batch(model, workload: Workload, batch: list[int]) -> None:
    prompts = [workload.prompts[i] for i in batch]
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding, as decoder-only generation needs
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids, attention_mask=mask, do_sample=False, pad_token_id=0,
            max_new_tokens=max(workload.output_lens[i] for i in batch),
        )


def _result(system: str, seconds: float, workload: Workload, settings: str) -> Result:
    out = workload.num_output_tokens
    total = out + workload.num_prompt_tokens
    return Result(system, seconds, out / seconds, total / seconds,
                  len(workload.prompts) / seconds, settings)


def print_table(results: list[Result]) -> None:
    header = f"{'system':<14}{'seconds':>10}{'out tok/s':>12}{'total tok/s':>13}{'req/s':>8}  settings"
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.system:<14}{r.seconds:>10.1f}{r.output_tokens_per_s:>12.1f}"
              f"{r.total_tokens_per_s:>13.1f}{r.requests_per_s:>8.2f}  {r.settings}")


def parse_range(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(":"))
    return low, high


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve bench throughput", description=__doc__)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=parse_range, default=(16, 256), help="LOW:HIGH")
    parser.add_argument("--output-len", type=parse_range, default=(16, 128), help="LOW:HIGH")
    parser.add_argument("--hf-batch-sizes", default="16", help="comma-separated; best is kept")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)

    from engine.model_runner import resolve_dtype
    from engine.models.loader import load_hf_config, resolve_model_path

    model_path = resolve_model_path(config.model, config.cache_dir)
    hf_config = load_hf_config(model_path)
    dtype = resolve_dtype(config, hf_config)
    workload = make_workload(args.num_prompts, args.input_len, args.output_len,
                             hf_config.vocab_size, args.workload_seed)
    ours = run_engine(config, workload)
    hf_runs = [run_hf(model_path, dtype, workload, int(b)) for b in args.hf_batch_sizes.split(",")]
    best_hf = max(hf_runs, key=lambda r: r.output_tokens_per_s)
    ratio = ours.output_tokens_per_s / best_hf.output_tokens_per_s

    print(f"\nmodel {model_path.name}, dtype {dtype}, {args.num_prompts} requests, "
          f"{workload.num_prompt_tokens} prompt + {workload.num_output_tokens} output tokens, "
          f"{torch.get_num_threads()} threads")
    print_table([ours, *hf_runs])
    print(f"\nthroughput ratio pagedserve / best HF: {ratio:.2f}x")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "model": model_path.name,
            "dtype": str(dtype),
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "prompt_tokens": workload.num_prompt_tokens,
            "output_tokens": workload.num_output_tokens,
            "threads": torch.get_num_threads(),
            "results": [asdict(r) for r in [ours, *hf_runs]],
            "ratio_vs_best_hf": ratio,
        }
        args.output.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
