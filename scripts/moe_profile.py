"""pagedserve on a mixture-of-experts shape: tok/s at 1 and B streams, and the
share of the model's time spent in the experts.

    .venv/bin/python scripts/moe_profile.py --model FOLDER [--dtype bfloat16] [--batch 32]

BENCHMARK-ONLY; no engine code is changed. A config-only folder
(scripts/make_shape_folder.py qwen3-moe-small) loaded with --load-format dummy.
The script wraps, from outside, FusedMoE.forward (router + experts: the whole
MoE block of a layer, engine/model/layers/moe.py) and the model's forward with
wall-clock timers (CPU execution is synchronous), keyed by the number of token
rows in the call, so decode steps (rows = streams) and prefill chunks are
counted apart. Reported per phase: experts / model forward, and the model
forward / the engine's whole step time.

Runs: one stream (128 prompt ids, --tokens out), then --batch streams (128
prompt ids each, --batch-tokens out) in one generate(); then, with
--profile-steps N, torch.profiler over N decode steps at each of
--profile-rows (after their prefill), top ops by self CPU time. Works on a
dense model too (the expert timers then stay at zero).
"""

from __future__ import annotations

import argparse
import collections
import random
import time

import torch


class Timers:
    def __init__(self) -> None:
        self.seconds = collections.defaultdict(float)
        self.calls = collections.defaultdict(int)

    def wrap(self, name: str, forward):
        def timed(x, *args, **kwargs):
            rows = x.numel() // x.shape[-1] if x.dim() > 1 else x.numel()
            started = time.perf_counter()
            out = forward(x, *args, **kwargs)
            self.seconds[name, rows] += time.perf_counter() - started
            self.calls[name, rows] += 1
            return out
        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def total(self, name: str, rows=None) -> float:
        return sum(s for (n, r), s in self.seconds.items()
                   if n == name and (rows is None or (r == rows) == (rows > 0)))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--profile-steps", type=int, default=4)
    parser.add_argument("--profile-rows", type=lambda v: [int(x) for x in v.split(",")],
                        default=[1, 32], help="decode batch sizes to profile (1,32)")
    parser.add_argument("--num-threads", type=int, default=0,
                        help="pagedserve's --num-threads (0: one per core)")
    return parser.parse_args()


def timed_model(args):
    """The engine, with its model's forward and every FusedMoE's timed."""
    from engine import LLM
    from engine.model.layers.moe import FusedMoE

    started = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, load_format="dummy", max_model_len=2048,
              num_threads=args.num_threads)
    print(f"start {time.perf_counter() - started:.0f} s", flush=True)
    model = llm.engine.runner.model
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters in the model's tensors: {n_params / 1e9:.2f} B", flush=True)
    timers = Timers()
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.forward = timers.wrap("moe", module.forward)
    model.forward = timers.wrap("model", model.forward)
    return llm, timers


def measure(args, llm, timers, prompt) -> None:
    from engine import SamplingParams

    def run(prompts, tokens):
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        llm.reset_prefix_cache()
        timers.reset()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
        return wall

    run([prompt()], 4)  # warm-up
    for streams, tokens in ((1, args.tokens), (args.batch, args.batch_tokens)):
        wall = run([prompt() for _ in range(streams)], tokens)
        report(timers, streams, tokens, wall)


def report(timers, streams: int, tokens: int, wall: float) -> None:
    decode_steps = timers.calls["model", streams]
    decode_model = timers.total("model", streams)
    decode_moe = timers.total("moe", streams)
    prefill_model = timers.total("model") - decode_model
    prefill_moe = timers.total("moe") - decode_moe
    print(f"{streams} stream(s) x 128 in / {tokens} out: {wall:.2f} s, "
          f"{streams * tokens / wall:.1f} output tok/s", flush=True)
    print(f"  decode: {decode_steps} steps of {streams} rows, model forward "
          f"{decode_model / max(decode_steps, 1) * 1e3:.1f} ms per step, experts "
          f"{decode_moe / max(decode_model, 1e-9) * 100:.1f} % of it "
          f"({decode_moe / max(decode_steps, 1) * 1e3:.1f} ms)", flush=True)
    print(f"  prefill (and mixed) calls: model forward {prefill_model:.2f} s, experts "
          f"{prefill_moe / max(prefill_model, 1e-9) * 100:.1f} % of it", flush=True)
    print(f"  model forward / wall: {timers.total('model') / wall * 100:.1f} %", flush=True)


def profile_steps(args, llm, timers, prompt) -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    from engine import SamplingParams

    engine = llm.engine
    for rows in args.profile_rows:
        llm.reset_prefix_cache()
        timers.reset()
        params = SamplingParams(temperature=0, max_tokens=args.profile_steps + 64, ignore_eos=True)
        for i in range(rows):
            engine.add_request(f"prof-{rows}-{i}", prompt(), params)
        while timers.calls["model", rows] == 0:  # until the prefill is done
            engine.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.profile_steps):
                with record_function("engine.step"):
                    engine.step()
        for i in range(rows):
            engine.abort_request(f"prof-{rows}-{i}")
        print(f"torch.profiler, {args.profile_steps} decode steps of {rows} rows, "
              f"top ops by self CPU time:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14,
                                        max_name_column_width=44))


def main() -> None:
    args = parse_args()
    llm, timers = timed_model(args)
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(128)]

    measure(args, llm, timers, prompt)
    if args.profile_steps:
        profile_steps(args, llm, timers, prompt)


if __name__ == "__main__":
    main()
