"""`pagedserve` — the command line.

    pagedserve serve [engine flags] [service flags]
    pagedserve generate --prompt "Hello" [--chat] [engine flags]
    pagedserve fleet --redis-url redis://host:6379
    pagedserve chat [--base-url URL] [--system "..."]
    pagedserve bench throughput|embeddings|prefix|serve|scheduler|kernels|fleet|offload|
                     structured|hostile [...]

Each command is a module with `main(argv) -> int | None` that parses its own
flags; this dispatcher only picks the module and hands it the rest of the
command line. It imports that module when the command runs, so `--help` is
instant and `serve` never loads the benchmarks.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import MappingProxyType

# command -> (module with main(argv), one line for --help)
COMMANDS = MappingProxyType({
    "serve": ("service.cli", "the OpenAI-compatible HTTP server"),
    "generate": ("pagedserve.generate", "complete or chat from the shell"),
    "fleet": ("service.fleet.presence", "the replicas and popular prefixes in the fleet's Redis"),
    "chat": ("clients.python.repl", "a terminal chat with a running server"),
})
BENCHMARKS = MappingProxyType({
    "throughput": ("bench.offline.throughput", "offline throughput: this engine vs HF generate"),
    "embeddings": ("bench.offline.embeddings", "embeddings/s and single-query latency: "
                   "pooling models vs sentence-transformers (and vLLM's CPU build)"),
    "prefix": ("bench.offline.prefix_caching",
               "the same workload with prefix caching off and on"),
    "serve": ("bench.serving.serve", "load generator for any OpenAI-compatible server"),
    "scheduler": ("bench.offline.scheduler", "scheduler overhead, with a null model"),
    "kernels": ("bench.kernels.kernels", "paged attention and store_kvcache"),
    "fleet": ("bench.fleet.fleet", "a new replica with the fleet's warm-up vs a cold one "
              "(Redis); --routing: each way of routing a multi-tenant load"),
    "offload": ("bench.fleet.offload", "KV offload tiers when prefixes outgrow the pool; "
                "warm-up from the Redis tier"),
    "structured": ("bench.offline.structured", "JSON-schema constrained requests in a batch: "
                   "throughput, mask time per step, compile time"),
    "output-overhead": ("bench.offline.output_overhead", "per-token engine overhead of one "
                        "long stream, CUMULATIVE vs DELTA outputs, with a null model"),
    "hostile": ("bench.serving.hostile", "a plain chat's latency and running streams' token "
                "gaps while hostile requests (compile-heavy schemas, 3,000 tools) are in flight"),
})


def build_parser() -> argparse.ArgumentParser:
    """The parser behind --help and usage errors; the commands parse their own flags."""
    parser = argparse.ArgumentParser(
        prog="pagedserve", description="an LLM server with a paged KV cache")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, summary) in COMMANDS.items():
        commands.add_parser(name, help=summary, add_help=False)
    bench = commands.add_parser("bench", help="benchmarks (each prints a table, --output JSON)")
    suites = bench.add_subparsers(dest="suite", metavar="SUITE", required=True)
    for name, (_, summary) in BENCHMARKS.items():
        suites.add_parser(name, help=summary, add_help=False)
    return parser


def resolve(argv: list[str]) -> tuple[str, list[str]]:
    """The module that runs `argv`, and the flags it gets. Anything else (no
    command, an unknown one, --help) goes to argparse, which prints and exits."""
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]][0], argv[1:]
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCHMARKS:
        return BENCHMARKS[argv[1]][0], argv[2:]
    parser = build_parser()
    parser.parse_args(argv)
    parser.error(f"cannot run {' '.join(argv)!r}")  # not reached: parse_args has exited


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    module, rest = resolve(argv)
    command = importlib.import_module(module)
    try:
        return command.main(rest) or 0
    except ValueError as exc:  # a configuration mistake: one clear line, no traceback
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 2
