"""Reasoning parsers on text (service/serving/reasoning.py): whole outputs, and the same
outputs fed in pieces cut at every place a stream could cut them.

Whatever the cuts, the pieces must join to what the whole text gives, and no
piece may carry part of a `<think>` / `</think>` tag as text.
"""

from __future__ import annotations

import itertools

import pytest

from service.serving.reasoning import (
    ReasoningPlan, Split, check_tokenizer, partial_tag, plan_reasoning,
)

OPENED = "<|im_start|>assistant\n<think>\n"  # Qwen3 thinking templates, DeepSeek-R1's
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3, enable_thinking=false
PLAIN = "<|im_start|>assistant\n"  # the model opens a thought itself, or not


def plan(parser: str, prompt: str, **kwargs) -> ReasoningPlan | None:
    return plan_reasoning(parser, prompt, **kwargs)


def pieces(plan: ReasoningPlan, text: str, cuts) -> list[Split]:
    """What a stream sends: one Split per piece of `text` (cut at `cuts`), then the end."""
    parser = plan.new_parser()
    bounds = [0, *cuts, len(text)]
    sent = [parser.feed(text[start:end]) for start, end in zip(bounds, bounds[1:])]
    return [*sent, parser.finish()]


def joined(splits: list[Split]) -> tuple[str, str]:
    return "".join(s.reasoning for s in splits), "".join(s.content for s in splits)


# (parser, prompt, output) -> (reasoning, content) of the whole output.
CASES = [
    # The template opened the thought: everything before </think> is thought.
    ("qwen3", OPENED, "Two and two.</think>\n\nFour.", ("Two and two.", "\n\nFour.")),
    ("deepseek_r1", OPENED, "Hm.</think>Four.", ("Hm.", "Four.")),
    # The model opens it itself (whitespace before the tag is dropped with it).
    ("qwen3", PLAIN, "<think>Hm, 2+2.</think>Four.", ("Hm, 2+2.", "Four.")),
    ("qwen3", PLAIN, "\n <think>Hm.</think>Four.", ("Hm.", "Four.")),
    ("deepseek_r1", PLAIN, "<think>Hm.</think>Four.", ("Hm.", "Four.")),
    # No tags at all: qwen3 reads an answer, deepseek_r1 an unfinished thought.
    ("qwen3", PLAIN, "Four.", (None, "Four.")),
    ("deepseek_r1", PLAIN, "Four.", ("Four.", None)),
    # deepseek_r1: R1 leaves out the opening tag; qwen3 keeps such text as content.
    ("deepseek_r1", PLAIN, "Hm.</think>Four.", ("Hm.", "Four.")),
    ("qwen3", PLAIN, "Hm.</think>Four.", (None, "Hm.</think>Four.")),
    # A thought never closed (cut by max_tokens) is all thought.
    ("qwen3", PLAIN, "<think>Let me see, two", ("Let me see, two", None)),
    ("qwen3", OPENED, "Let me see, two </thi", ("Let me see, two </thi", None)),
    # Text after the first </think> is content, a later tag included.
    ("qwen3", OPENED, "a</think>b<think>c</think>d", ("a", "b<think>c</think>d")),
    ("qwen3", OPENED, "a<think>b</think>c", ("a<think>b", "c")),
    # Only a closing tag: an empty thought, and no text after it either.
    ("qwen3", OPENED, "</think>", (None, "")),
    ("qwen3", OPENED, "</think>Four.", (None, "Four.")),
    ("qwen3", PLAIN, "", (None, "")),
    # Something that starts like the tag but is not it.
    ("qwen3", PLAIN, "<thinking>Four.", (None, "<thinking>Four.")),
    ("qwen3", PLAIN, "<thin", (None, "<thin")),
    ("deepseek_r1", PLAIN, "<thin", ("<thin", None)),
    ("qwen3", OPENED, "a </thinker> b</think>c", ("a </thinker> b", "c")),
]


@pytest.mark.parametrize("parser, prompt, text, expected", CASES)
def test_whole_output(parser, prompt, text, expected):
    assert plan(parser, prompt).split(text) == expected


@pytest.mark.parametrize("parser, prompt, text, expected", CASES)
def test_every_single_cut_and_every_pair_of_cuts_join_to_the_whole(parser, prompt, text,
                                                                   expected):
    whole = plan(parser, prompt)
    reasoning, content = expected
    points = range(1, len(text))
    for cuts in itertools.chain(([c] for c in points), itertools.combinations(points, 2)):
        # A tag cut in two and sent as text would show here: "</th" in the
        # reasoning, "ink>" in the content.
        assert joined(pieces(whole, text, cuts)) == (reasoning or "", content or ""), cuts


def test_one_character_at_a_time():
    text = "Step one. Step two.</think>\n\nThe answer is 4."
    splits = pieces(plan("qwen3", OPENED), text, range(1, len(text)))
    thought = [s.reasoning for s in splits if s.reasoning]
    answer = [s.content for s in splits if s.content]
    assert "".join(thought) == "Step one. Step two." and "".join(answer) == "\n\nThe answer is 4."
    # Every thought piece comes before the first answer piece; none is both.
    first_answer = next(i for i, s in enumerate(splits) if s.content)
    assert all(not s.reasoning for s in splits[first_answer:])


def test_a_delta_holding_the_end_of_the_thought_and_the_start_of_the_answer():
    parser = plan("qwen3", OPENED).new_parser()
    assert parser.feed("Hm") == Split("Hm", "")
    assert parser.feed(". </th") == Split(". ", "")  # "</th" is held back
    assert parser.feed("ink>Four") == Split("", "Four")
    assert parser.feed(".") == Split("", ".")
    assert parser.finish() == Split()


def test_held_back_text_that_was_no_tag_comes_out_as_what_it_is():
    parser = plan("qwen3", OPENED).new_parser()
    assert parser.feed("a </") == Split("a ", "")
    assert parser.feed("b>") == Split("</b>", "")
    assert parser.feed("</thi") == Split()
    assert parser.finish() == Split("</thi", "")  # cut short: still thought
    opening = plan("qwen3", PLAIN).new_parser()
    assert opening.feed("  <th") == Split()  # may still open a thought
    assert opening.feed("e") == Split("", "  <the")


def test_the_prompt_decides_where_the_output_starts():
    assert plan("qwen3", CLOSED) is None  # enable_thinking=false: all content
    assert plan("deepseek_r1", CLOSED) is None
    assert plan("qwen3", OPENED).start == "thinking"
    assert plan("qwen3", PLAIN).start == "opening"
    assert plan("qwen3", "<think>earlier</think>\n<|im_start|>assistant\n").start == "opening"
    # The request turns thinking off, with a template that cannot: all content.
    assert plan("qwen3", PLAIN, template_kwargs={"enable_thinking": False}) is None
    assert plan("deepseek_r1", PLAIN, template_kwargs={"enable_thinking": False}) is None
    assert plan("qwen3", PLAIN, template_kwargs={"enable_thinking": True}).start == "opening"
    # A constrained output (response_format, tools' grammar) has no room for a thought.
    assert plan("qwen3", OPENED, constrained=True) is None
    assert plan_reasoning(None, OPENED) is None  # no --reasoning-parser


def test_partial_tag():
    assert partial_tag("abc</thi", "</think>") == 5
    assert partial_tag("abc<", "</think>") == 1
    assert partial_tag("abc</think>", "</think>") == 0  # a whole tag is not a part
    assert partial_tag("", "</think>") == 0


class Vocab:
    def __init__(self, *tokens: str) -> None:
        self.tokens = {token: i for i, token in enumerate(tokens)}

    def get_vocab(self) -> dict[str, int]:
        return self.tokens


def test_a_parser_needs_the_think_tokens():
    check_tokenizer("qwen3", Vocab("a", "<think>", "</think>"))
    check_tokenizer(None, Vocab("a"))
    with pytest.raises(ValueError, match="no </think> token"):
        check_tokenizer("qwen3", Vocab("a", "<think>"))
    with pytest.raises(ValueError, match="no <think> or </think> token"):
        check_tokenizer("deepseek_r1", Vocab("a"))


# -- the chat route: tool calls are read out of the content only ------------------------
CALL = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
THOUGHT_WITH_CALL = f"Maybe {CALL}? No, first think.</think>Let me check.{CALL}"


def hermes_plan():
    from service.tool_calls.plan import ToolPlan

    return ToolPlan(choice="auto", tools=(), parser="hermes")


def test_a_whole_answer_reads_calls_only_after_the_thought():
    from service.serving.chat_answer import assistant_message as _message

    message, calls = _message(THOUGHT_WITH_CALL, hermes_plan(), plan("qwen3", OPENED))
    assert message.reasoning_content == message.reasoning == f"Maybe {CALL}? No, first think."
    assert message.content == "Let me check."
    assert calls == 1 and message.tool_calls[0].function.name == "get_time"
    only_thought, calls = _message("Hm, <tool_call>", hermes_plan(), plan("qwen3", OPENED))
    assert (only_thought.reasoning_content, only_thought.content, calls) == (
        "Hm, <tool_call>", None, 0)
    no_parser, _ = _message("Hm.</think>Four.", None, None)
    assert (no_parser.content, no_parser.reasoning_content) == ("Hm.</think>Four.", None)


class Choice:
    def __init__(self, delta_text: str, finish_reason: str | None = None) -> None:
        self.delta_text, self.finish_reason = delta_text, finish_reason


def test_a_stream_reads_calls_only_after_the_thought():
    from service.serving.chat_answer import choice_delta as _choice_delta

    tools, thinking = hermes_plan(), plan("qwen3", OPENED)
    thinker, parser = thinking.new_parser(), tools.new_parser()
    text = THOUGHT_WITH_CALL
    deltas = [_choice_delta(Choice(text[i:i + 3], "stop" if i + 3 >= len(text) else None),
                            thinker, parser, tools) for i in range(0, len(text), 3)]
    thought = "".join(d.reasoning_content or "" for d, _ in deltas)
    assert thought == f"Maybe {CALL}? No, first think."
    assert all(d.reasoning == d.reasoning_content for d, _ in deltas)
    assert "".join(d.content or "" for d, _ in deltas) == "Let me check."
    calls = [c for d, _ in deltas for c in d.tool_calls or ()]
    assert calls[0].function.name == "get_time" and deltas[-1][1] == "tool_calls"


def test_a_thought_sent_back_in_the_history_reaches_the_template():
    from service.protocol.requests import ChatMessage
    from service.tool_calls.plan import template_messages

    history = [ChatMessage("user", "2+2?"),
               ChatMessage("assistant", "4", reasoning="Two and two."),
               ChatMessage("assistant", "4", reasoning_content="Sum."),
               ChatMessage("user", "Sure?", reasoning="ignored: not an assistant turn")]
    rendered = template_messages(history, None, renders_tools=False)
    assert [m.get("reasoning_content") for m in rendered] == [None, "Two and two.", "Sum.", None]
