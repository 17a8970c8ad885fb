"""`pagedserve generate`: complete (or chat) a few prompts from the shell.

    pagedserve generate --prompt "Hello" [--prompt ...] [--chat] [engine flags]
"""

from __future__ import annotations

import argparse

from engine.args import add_engine_args, config_from_args
from engine.llm import LLM
from engine.sampling_params import SamplingParams

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
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)  # a bad flag value fails before the model loads
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.sampling_seed)
    llm = LLM.from_config(config)
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
