"""Reasoning output (`--reasoning-parser qwen3 | deepseek_r1`, as vLLM's): a
thinking model's text -> the thought (`reasoning_content`) and the answer
(`content`), whole or piece by piece as a stream delivers it.

    the prompt ends with     the output                  reasoning     content
    "<think>\\n"              "Two and two.</think>\\n\\n4"  "Two and two." "\\n\\n4"
    neither tag              "<think>Hm.</think>4"        "Hm."          "4"
    neither tag (qwen3)      "4"                          -              "4"
    neither tag (deepseek_r1) "Hm.</think>4"              "Hm."          "4"
    "</think>\\n\\n"           "4"                          -              "4"

The output is a thought until `</think>` when the model opened one (it begins,
whitespace aside, with `<think>`, which is dropped) or when the chat template
already did: Qwen3's and DeepSeek-R1's thinking templates end the prompt with
"<think>\\n". A prompt that ends with a closed, empty thought
("<think>\\n\\n</think>\\n\\n": Qwen3's template with enable_thinking=false)
or, where the prompt opens none, a request with
`chat_template_kwargs.enable_thinking: false` means no thought: the output
is all content. Otherwise the two parsers differ only in
an output that does not open with `<think>`: qwen3 reads it as all content
(a model that did not think), deepseek_r1 as a thought (DeepSeek-R1 often
leaves out the opening tag) until `</think>`. Text after the first `</think>`
is content, verbatim (a later tag included); a thought never closed (cut by
max_tokens) is all reasoning. Whole and streamed answers use one parser, so
they cannot disagree; a tag split across deltas is held back until it is
whole, and never sent as text.

Where this differs from vLLM: its recent qwen3 parser reads any output
without `</think>` as reasoning unless enable_thinking is false, and it
decides on token ids; this reads text, so the tags must decode as text
(Qwen3's and DeepSeek-R1's are added tokens, not special ones, so they do
even with skip_special_tokens).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

THINK_START, THINK_END = "<think>", "</think>"
# The phases of one output.
OPENING = "opening"  # nothing seen yet but whitespace and maybe part of "<think>"
THINKING = "thinking"
ANSWERING = "answering"


@dataclass
class Split:
    """What a piece of output was: thought, answer, or some of each (in that order)."""

    reasoning: str = ""
    content: str = ""

    def add(self, other: "Split") -> "Split":
        self.reasoning += other.reasoning
        self.content += other.content
        return self


class ReasoningParser:
    """One choice's output, fed piece by piece (feed), then ended (finish)."""

    def __init__(self, phase: str, unopened: str) -> None:
        self.phase = phase
        self.unopened = unopened  # where an output that does not open with <think> goes
        self.held = ""  # text that may be the start of a tag

    def feed(self, text: str) -> Split:
        split = Split()
        self.held += text
        if self.phase == OPENING:
            self._open()
        if self.phase == THINKING:
            end = self.held.find(THINK_END)
            if end < 0:  # all of it is thought, but what may be the start of "</think>"
                cut = len(self.held) - partial_tag(self.held, THINK_END)
                split.reasoning, self.held = self.held[:cut], self.held[cut:]
                return split
            split.reasoning = self.held[:end]
            self.held = self.held[end + len(THINK_END):]
            self.phase = ANSWERING
        if self.phase == ANSWERING:
            split.content, self.held = self.held, ""
        return split

    def finish(self) -> Split:
        """The end of the output: what was held back, as what it turned out to be."""
        held, self.held = self.held, ""
        phase = self.unopened if self.phase == OPENING else self.phase
        return Split(reasoning=held) if phase == THINKING else Split(content=held)

    def _open(self) -> None:
        start = self.held.lstrip()
        if start.startswith(THINK_START):
            self.held, self.phase = start[len(THINK_START):], THINKING
        elif not THINK_START.startswith(start):  # "" and "<th" may still open it
            self.phase = self.unopened


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass(frozen=True)
class ReasoningPlan:
    """How one request's outputs are read: the phase each starts in."""

    start: str
    unopened: str

    def new_parser(self) -> ReasoningParser:
        return ReasoningParser(self.start, self.unopened)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output: (reasoning, content), each None when there is none.

        Content is "" rather than None only when there was no thought either,
        as without a reasoning parser.
        """
        parser = self.new_parser()
        split = parser.feed(text).add(parser.finish())
        reasoning = split.reasoning or None
        return reasoning, (None if reasoning is not None and not split.content
                           else split.content)


def plan_reasoning(parser: str | None, prompt: str, template_kwargs: dict | None = None,
                   constrained: bool = False) -> ReasoningPlan | None:
    """The request's plan, or None when its output is all content.

    `prompt` is the rendered chat prompt: how it ends tells whether the
    template opened a thought, closed an empty one, or left it to the model.
    A constrained output (response_format, structured_outputs, the grammar of
    tool_choice "required" or a named function) follows its grammar from the
    first token, so it holds no thought: it is all content, as it must be to
    parse (vLLM can instead start the grammar after `</think>`; this cannot).
    """
    if parser is None or constrained:
        return None
    tail = prompt.rstrip()
    if tail.endswith(THINK_START):
        start = THINKING
    elif tail.endswith(THINK_END) or (template_kwargs or {}).get("enable_thinking") is False:
        return None
    else:
        start = OPENING
    return ReasoningPlan(start, THINKING if parser == "deepseek_r1" else ANSWERING)


def check_tokenizer(parser: str | None, tokenizer) -> None:
    """Refuse a parser for a model whose tokenizer has no `<think>` / `</think>` tokens
    (it was not trained to think in them; vLLM refuses it too), and point out the
    flag for one that has them."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    missing = [tag for tag in (THINK_START, THINK_END) if tag not in vocab]
    if parser is None:
        if not missing:
            logger.info("the model's tokenizer has <think> and </think>: with "
                        "--reasoning-parser (qwen3, deepseek_r1) a thought is returned as "
                        "reasoning_content; without, it stays in the content")
    elif missing:
        raise ValueError(f"--reasoning-parser {parser}: the tokenizer has no "
                         f"{' or '.join(missing)} token, so this model does not think in "
                         "<think>...</think>; leave the flag out")
