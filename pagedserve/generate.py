"""`pagedserve generate`: complete (or chat) a few prompts from the shell.

    pagedserve generate --prompt "Hello" [--prompt ...] [--chat] [engine flags]
        [--json-schema FILE | --regex RE | --choice A --choice B ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.args import add_engine_args, config_from_args
from engine.frontend.llm import LLM
from engine.sampling_params import SamplingParams
from engine.sampling.structured_outputs import StructuredOutputsParams

DEFAULT_PROMPT = "Give me three tips for writing clear code."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve generate",
                                     description="complete or chat from the shell")
    parser.add_argument("--prompt", action="append", help="repeat for several prompts")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--sampling-seed", type=int, default=None)
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", type=Path, metavar="FILE",
                            help="the output is JSON valid against this JSON Schema file")
    constraint.add_argument("--regex", help="the output matches this regular expression")
    constraint.add_argument("--choice", action="append", help="the output is one of these "
                            "strings (repeat the flag)")
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)  # a bad flag value fails before the model loads
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.sampling_seed,
                            structured_outputs=_constraint(args))
    llm = LLM.from_config(config)
    try:
        llm.engine.check_params(params)  # an invalid schema or regex: its message, not a traceback
    except ValueError as exc:
        raise SystemExit(f"pagedserve generate: {exc}") from None
    prompts = args.prompt or [DEFAULT_PROMPT]
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


def _constraint(args) -> StructuredOutputsParams | None:
    if args.json_schema is not None:
        try:
            schema = json.loads(args.json_schema.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"--json-schema {args.json_schema}: {exc}") from None
        return StructuredOutputsParams(json=schema)
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    if args.choice:
        return StructuredOutputsParams(choice=args.choice)
    return None
