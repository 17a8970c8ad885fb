"""Tool-call parsers on text: whole, and fed in pieces cut at every place a stream could cut.

A stream delivers a choice's text in arbitrary pieces (one or more tokens per
update); whatever the cuts, the content and the calls put back together must
be what the whole text gives.
"""

from __future__ import annotations

import json
import random

import pytest

from service.tool_parsers import (
    ArgumentsParser, CallListParser, HermesParser, Llama3JsonParser, Parsed, detect_parser,
    parse_text,
)

CALLS = ('[{"name": "get_weather", "arguments": {"city": "Paris {\\"old\\"}", "days": [1, 2]}}, '
         '{"name": "get_time", "arguments": {}}]')


def streamed(parser, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    """Feed `text` cut at `cuts`, then join the deltas as an SDK accumulates them."""
    parsed = Parsed()
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        parsed.add(parser.feed(text[start:end]))
    parsed.add(parser.finish())
    calls: list[dict] = []
    for piece in parsed.calls:
        if piece.id is not None:
            assert piece.index == len(calls) and piece.id.startswith("call_")
            calls.append({"name": piece.name, "arguments": piece.arguments})
        else:
            assert piece.name is None
            calls[piece.index]["arguments"] += piece.arguments
    return parsed.content, calls


def whole(parser, text: str) -> tuple[str, list[dict]]:
    content, calls = parse_text(parser, text)
    return content, [{"name": c.name, "arguments": c.arguments} for c in calls]


def every_cut(make_parser, text: str, expected) -> None:
    assert whole(make_parser(), text) == expected
    for cut in range(len(text) + 1):
        assert streamed(make_parser(), text, [cut]) == expected, cut
    assert streamed(make_parser(), text, list(range(1, len(text)))) == expected
    rng = random.Random(7)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        assert streamed(make_parser(), text, cuts) == expected, cuts


def test_a_list_of_calls_with_braces_and_quotes_inside_strings():
    expected = ("", [
        {"name": "get_weather", "arguments": '{"city": "Paris {\\"old\\"}", "days": [1, 2]}'},
        {"name": "get_time", "arguments": "{}"},
    ])
    every_cut(CallListParser, CALLS, expected)
    for _, calls in [expected]:
        assert json.loads(calls[0]["arguments"])["city"] == 'Paris {"old"}'


def test_compact_and_spaced_lists_give_the_same_calls():
    compact = '[{"name":"f","arguments":{"a":1}},{"name":"g","arguments":{"b":"]"}}]'
    spaced = '[ {"name" : "f", "arguments" : {"a":1} } , { "name": "g", "arguments":{"b":"]"}} ]'
    expected = ("", [{"name": "f", "arguments": '{"a":1}'},
                     {"name": "g", "arguments": '{"b":"]"}'}])
    every_cut(CallListParser, compact, expected)
    assert whole(CallListParser(), spaced) == expected


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    assert whole(CallListParser(max_calls=1), CALLS)[1] == [
        {"name": "get_weather", "arguments": '{"city": "Paris {\\"old\\"}", "days": [1, 2]}'}]


def test_a_list_cut_short_keeps_what_was_written():
    cut = CALLS[:60]  # inside the first call's arguments
    assert whole(CallListParser(), cut) == ("", [
        {"name": "get_weather", "arguments": '{"city": "Paris {\\"old'}])
    # Before the first name is complete there is no call: the text is the content.
    assert whole(CallListParser(), '[{"name": "get_w') == ('[{"name": "get_w', [])


def test_a_named_function_is_all_arguments():
    text = '{"city": "Paris", "days": [1, 2]}'
    every_cut(lambda: ArgumentsParser("get_weather"), text,
              ("", [{"name": "get_weather", "arguments": text}]))
    assert whole(ArgumentsParser("f"), "") == ("", [{"name": "f", "arguments": ""}])


HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
          '</tool_call>')


def test_hermes_content_then_calls():
    every_cut(HermesParser, HERMES, ("Let me check. ", [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"name": "get_time", "arguments": '{"tz": "CET"}'},
    ]))


def test_hermes_plain_text_with_angle_brackets_is_content():
    text = "a < b and <tool but not a call <tool_cal"
    every_cut(HermesParser, text, (text, []))


def test_hermes_a_call_that_does_not_parse_stays_content():
    text = "<tool_call>{not json}</tool_call> done"
    every_cut(HermesParser, text, ("<tool_call>{not json}</tool_call> done", []))


def test_hermes_a_call_left_open_at_the_end_counts_if_it_parses():
    assert whole(HermesParser(), '<tool_call>{"name": "f", "arguments": {"x": 1}}') == (
        "", [{"name": "f", "arguments": '{"x": 1}'}])
    assert whole(HermesParser(), '<tool_call>{"name": "f", "argu') == (
        '<tool_call>{"name": "f", "argu</tool_call>', [])


def test_llama3_json_calls_and_content():
    every_cut(Llama3JsonParser, '{"name": "f", "parameters": {"q": "a;b"}}; {"name": "g", '
              '"parameters": {}}',
              ("", [{"name": "f", "arguments": '{"q": "a;b"}'}, {"name": "g", "arguments": "{}"}]))
    every_cut(Llama3JsonParser, '<|python_tag|>{"name": "f", "parameters": {}}',
              ("", [{"name": "f", "arguments": "{}"}]))
    every_cut(Llama3JsonParser, "The answer is {42}.", ("The answer is {42}.", []))
    every_cut(Llama3JsonParser, '{"not": "a call"}', ('{"not": "a call"}', []))


@pytest.mark.parametrize("template,configured,parser", [
    ("{{ '<tool_call>' }}{{ tools }}", "auto", "hermes"),
    ("{{ '<|python_tag|>' }}{{ tools }}", "auto", "llama3_json"),
    ("{{ messages }}", "auto", None),
    ("{{ '<tool_call>' }}", "none", None),
    ("{{ messages }}", "hermes", "hermes"),
])
def test_the_auto_format_is_read_from_the_template(template, configured, parser):
    assert detect_parser(template, configured) == parser
