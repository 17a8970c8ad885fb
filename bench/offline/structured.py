"""`pagedserve bench structured`: what JSON-schema constraints cost in a batch.

    pagedserve bench structured [--requests 64] [--output-len 128] [--output r.json] [engine flags]

One engine, the same --requests chat requests twice: first none constrained,
then every other one constrained by one of five JSON schemas (nested objects,
arrays, enums, bounded numbers, a $ref). Unconstrained requests decode
--output-len tokens (ignore_eos); a constrained one stops when its JSON is
complete. Reported: output tokens per second of each run, the time the
constrained rows' token masks take per step (xgrammar fills one bitmask row
per constrained sequence and applies them in one call), and the compile time
of each schema on a fresh compiler, after the one-off vocabulary preparation.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import engine.sampling.sampler as sampler_module
from bench.common.report import print_table, write_json
from engine.args import add_engine_args, config_from_args
from engine.frontend.llm import LLM
from engine.sampling_params import SamplingParams
from engine.sampling.structured_outputs import StructuredOutputs, StructuredOutputsParams

SCHEMAS = {
    "person": {"type": "object", "required": ["name", "age"],
               "properties": {"name": {"type": "string", "maxLength": 30},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    "order": {"type": "object", "required": ["customer", "items"],
              "properties": {"customer": {"type": "object", "required": ["id", "vip"],
                                          "properties": {"id": {"type": "integer"},
                                                         "vip": {"type": "boolean"}}},
                             "items": {"type": "array", "minItems": 1, "maxItems": 3,
                                       "items": {"type": "string", "maxLength": 20}}}},
    "weather": {"type": "object", "required": ["sky", "temperature"],
                "properties": {"sky": {"enum": ["sunny", "cloudy", "rainy"]},
                               "temperature": {"type": "number", "minimum": -30,
                                               "maximum": 50}}},
    "points": {"type": "array", "minItems": 1, "maxItems": 3,
               "items": {"type": "object", "required": ["x", "y"],
                         "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}},
    "review": {"$defs": {"score": {"type": "integer", "minimum": 1, "maximum": 5}},
               "type": "object", "required": ["title", "score"],
               "properties": {"title": {"type": "string", "maxLength": 30},
                              "score": {"$ref": "#/$defs/score"}}},
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve bench structured",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--output", type=str, default=None, help="write the results as JSON")
    add_engine_args(parser)
    return parser


class MaskTimer:
    """Times the sampler's grammar-mask step (a bench-only wrapper, restored after)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._original = sampler_module.apply_grammar_masks

    def __enter__(self) -> "MaskTimer":
        def timed(logits, grammars):
            started = time.perf_counter()
            try:
                return self._original(logits, grammars)
            finally:
                if any(g is not None for g in grammars):
                    self.seconds.append(time.perf_counter() - started)
        sampler_module.apply_grammar_masks = timed
        return self

    def __exit__(self, *exc) -> None:
        sampler_module.apply_grammar_masks = self._original


def run(llm: LLM, args, constrained: bool) -> dict:
    conversations, params = [], []
    names = list(SCHEMAS)
    for i in range(args.requests):
        conversations.append([{"role": "user", "content": f"Describe item {i} as JSON."}])
        schema = SCHEMAS[names[(i // 2) % len(names)]] if constrained and i % 2 else None
        params.append(SamplingParams(
            temperature=0, max_tokens=args.output_len, ignore_eos=schema is None,
            structured_outputs=None if schema is None else StructuredOutputsParams(json=schema)))
    with MaskTimer() as masks:
        started = time.perf_counter()
        outputs = llm.chat(conversations, params)
        seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"constrained": constrained, "seconds": seconds, "output_tokens": tokens,
            "output_tok_s": tokens / seconds, "mask_steps": len(masks.seconds),
            "mask_ms_median": 1e3 * statistics.median(masks.seconds) if masks.seconds else 0.0,
            "mask_ms_max": 1e3 * max(masks.seconds) if masks.seconds else 0.0}


def compile_times(llm: LLM) -> dict[str, float]:
    """Milliseconds: the vocabulary once, then each schema, on a fresh compiler."""
    engine = llm.engine
    fresh = StructuredOutputs(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    started = time.perf_counter()
    fresh.compiler()
    times = {"vocabulary": 1e3 * (time.perf_counter() - started)}
    for name, schema in SCHEMAS.items():
        started = time.perf_counter()
        fresh.compile(StructuredOutputsParams(json=schema))
        times[name] = 1e3 * (time.perf_counter() - started)
    return times


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    llm = LLM.from_config(config_from_args(args))
    compiled = compile_times(llm)
    runs = [run(llm, args, constrained=False), run(llm, args, constrained=True)]
    print_table(["run", "seconds", "output tok", "out tok/s", "steps masked", "mask ms (median)",
                 "mask ms (max)"],
                [["half constrained" if r["constrained"] else "none constrained",
                  f"{r['seconds']:.1f}", r["output_tokens"], f"{r['output_tok_s']:.1f}",
                  r["mask_steps"], f"{r['mask_ms_median']:.2f}", f"{r['mask_ms_max']:.2f}"]
                 for r in runs], title=f"{args.requests} requests, greedy")
    print_table(["compile", "ms"], [[name, f"{ms:.1f}"] for name, ms in compiled.items()])
    if args.output:
        write_json(Path(args.output), {"runs": runs, "compile_ms": compiled})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
