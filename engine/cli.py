"""`pagedserve` — the command line.

    pagedserve serve [engine flags] [service flags]     (see service/cli.py)
    pagedserve generate --prompt "Hello" [--chat] [engine flags]
    pagedserve bench throughput|kernels|prefix|serve|scheduler [...]

Engine flags mirror EngineConfig field for field (vLLM's spelling), so a flag
and the offline `LLM(...)` argument of the same name mean the same thing.
"""

from __future__ import annotations

import argparse
import sys

from engine.config import DEFAULT_MODEL, DTYPES, EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=DEFAULT_MODEL,
                       help="HF folder, .gguf file, or %(default)s (the default)")
    group.add_argument("--dtype", default="auto", choices=DTYPES)
    group.add_argument("--quantization", default=None, choices=("int4",),
                       help="weight-only int4 (CPU, bfloat16): faster small-batch decode")
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-num-batched-tokens", type=int, default=8192)
    group.add_argument("--max-model-len", type=int, default=0,
                       help="0 means the model's own limit")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    group.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30,
                       help="KV cache budget on CPU (default 1 GiB)")
    group.add_argument("--tensor-parallel-size", type=int, default=1)
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=True)
    group.add_argument("--kernel-backend", default="auto", choices=("auto", "torch", "triton"))
    group.add_argument("--device", default="auto")
    group.add_argument("--num-threads", type=int, default=0,
                       help="CPU threads for the model (0: torch's default, one per core)")
    group.add_argument("--seed", type=int, default=0)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_prefix_caching=args.enable_prefix_caching,
        kernel_backend=args.kernel_backend,
        device=args.device,
        num_threads=args.num_threads,
        seed=args.seed,
    )


def generate_command(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM.from_config(config_from_args(args))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
        seed=args.sampling_seed,
    )
    prompts = args.prompt or ["Give me three tips for writing clear code."]
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in prompts]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        print(f"> {prompt}\n{completion.text}\n[{len(completion.token_ids)} tokens, "
              f"finish_reason={completion.finish_reason}]\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    # Listed for --help; main() hands `serve ...` to service/cli.py, whose
    # parser takes the engine flags plus the service flags.
    commands.add_parser("serve", help="the OpenAI-compatible HTTP server", add_help=False)

    gen = commands.add_parser("generate", help="complete or chat from the shell")
    gen.add_argument("--prompt", action="append", help="repeat for several prompts")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(gen)
    gen.set_defaults(func=generate_command)

    bench = commands.add_parser("bench", help="benchmarks (each prints a table, --output JSON)")
    bench.add_argument("suite", choices=("throughput", "kernels", "prefix", "serve", "scheduler"))
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=bench_command)
    return parser


def bench_command(args: argparse.Namespace) -> int:
    if args.suite == "throughput":
        from bench.throughput import main as run
    elif args.suite == "prefix":
        from bench.prefix_caching import main as run
    elif args.suite == "serve":
        from bench.serve import main as run
    elif args.suite == "scheduler":
        from bench.scheduler import main as run
    else:
        from bench.kernels import main as run
    return run(args.rest) or 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # argparse's REMAINDER would swallow nothing before a flag
        from service.cli import main as serve_main

        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # configuration mistakes: one clear line, no traceback
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
