"""Tool-call parsers on text: whole, and fed in pieces cut at every place a stream could cut.

A stream delivers a choice's text in arbitrary pieces (one or more tokens per
update); whatever the cuts, the content and the calls put back together must
be what the whole text gives.
"""

from __future__ import annotations

import json
import random

import msgspec
import pytest

from service.protocol.requests import ChatCompletionRequest
from service.tool_calls.arguments import ArgumentsParser
from service.tool_calls.base import Parsed, parse_text
from service.tool_calls.call_list import CallListParser
from service.tool_calls.hermes import HermesParser
from service.tool_calls.llama3_json import Llama3JsonParser
from service.tool_calls.mistral import MistralParser
from service.tool_calls.plan import plan_tools
from service.tool_calls.registry import detect_parser

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
            assert piece.index == len(calls) and id_fits(parser, piece.id)
            calls.append({"name": piece.name, "arguments": piece.arguments})
        else:
            assert piece.name is None
            calls[piece.index]["arguments"] += piece.arguments
    return parsed.content, calls


def id_fits(parser, call_id: str) -> bool:
    if isinstance(parser, MistralParser):  # its templates take back 9 letters and digits only
        return len(call_id) == 9 and call_id.isalnum()
    return call_id.startswith("call_")


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


def test_hermes_spaces_after_a_call_are_content_only_before_text():
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    f = {"name": "f", "arguments": "{}"}
    every_cut(HermesParser, call + "\n\nDone.", ("\n\nDone.", [f]))
    every_cut(HermesParser, call + "\n \n", ("", [f]))
    every_cut(HermesParser, f"{call}\n{call}\n", ("", [f, f]))


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
    ("[AVAILABLE_TOOLS] {{ tools }}{{ '[TOOL_CALLS] [' }}", "auto", "mistral"),
    ("{{ messages }}", "mistral", "mistral"),
    ("{{ messages }}", "auto", None),
    ("{{ '<tool_call>' }}", "none", None),
    ("{{ messages }}", "hermes", "hermes"),
])
def test_the_auto_format_is_read_from_the_template(template, configured, parser):
    assert detect_parser(template, configured) == parser


MISTRAL = ('Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": '
           '"Paris {\\"old\\"}", "days": [1, 2]}}, {"name": "get_time", "arguments": {}}]')
WEATHER_CALL = {"name": "get_weather", "arguments": '{"city": "Paris {\\"old\\"}", "days": [1, 2]}'}


def test_mistral_content_then_a_list_of_calls():
    every_cut(MistralParser, MISTRAL, ("Let me check. ", [
        WEATHER_CALL, {"name": "get_time", "arguments": "{}"}]))
    # Mistral 7B v0.3 writes no space after the marker, compactly; spaces around are the format's.
    every_cut(MistralParser, '[TOOL_CALLS][{"name":"f","arguments":{"a":"]"}}]\n',
              ("", [{"name": "f", "arguments": '{"a": "]"}'}]))


def test_mistral_name_args_form_of_newer_templates():
    text = ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris {\\"old\\"}", "days": [1, 2]}'
            '[TOOL_CALLS]get_time{}')
    every_cut(MistralParser, text, ("", [WEATHER_CALL, {"name": "get_time", "arguments": "{}"}]))


def test_mistral_a_call_goes_out_when_its_object_is_complete():
    parser, sent = MistralParser(), []
    for i, char in enumerate(MISTRAL):
        parsed = parser.feed(char)
        assert "[" not in parsed.content and "{" not in parsed.content  # no marker, no JSON
        sent += [(i, piece.name) for piece in parsed.calls]
    first_end = MISTRAL.index("}},") + 1
    assert sent == [(first_end, "get_weather"), (len(MISTRAL) - 2, "get_time")]
    assert parser.finish() == Parsed()


@pytest.mark.parametrize("text", [
    "Plain text, with [brackets] and {braces} and a [TOOL_CALL",
    "[TOOL_CALLS] and then prose",  # not a list nor a name{...}
    '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1,}}]',  # JSON that never parses
    '[TOOL_CALLS] [{"tool": "f"}] after',  # JSON, but not a call
    '[TOOL_CALLS] [{"name": "f", "argu',  # cut short (max_tokens) before a call completed
    "[TOOL_CALLS]",
])
def test_mistral_what_is_no_call_is_content_whole(text):
    every_cut(MistralParser, text, (text, []))


def test_mistral_content_after_the_calls_and_a_call_cut_short_after_one():
    call = '[TOOL_CALLS] [{"name": "f", "arguments": {}}]'
    f = {"name": "f", "arguments": "{}"}
    every_cut(MistralParser, call + " Done.", (" Done.", [f]))
    every_cut(MistralParser, call[:-1] + ', {"name": "g", "ar',
              (', {"name": "g", "ar', [f]))  # the call that did not complete is content
    every_cut(MistralParser, '[TOOL_CALLS]f{"a": 1} and prose', (" and prose", [
        {"name": "f", "arguments": '{"a": 1}'}]))


def test_mistral_parallel_tool_calls_false_keeps_the_first_call_only():
    assert whole(MistralParser(max_calls=1), MISTRAL) == ("Let me check. ", [WEATHER_CALL])
    assert whole(MistralParser(max_calls=1), '[TOOL_CALLS]f{}[TOOL_CALLS]g{}') == (
        "", [{"name": "f", "arguments": "{}"}])


@pytest.mark.parametrize("choice,text", [
    ("auto", '[TOOL_CALLS] [{"name": "f", "arguments": {}}]'),
    ("required", '[{"name": "f", "arguments": {}}]'),
    ({"type": "function", "function": {"name": "f"}}, "{}"),
])
def test_a_mistral_model_keeps_its_marker_and_gets_its_ids(choice, text):
    body = msgspec.convert({"messages": [{"role": "user", "content": "Hi"}], "tool_choice": choice,
                            "tools": [{"type": "function", "function": {"name": "f"}}]},
                           ChatCompletionRequest)
    plan = plan_tools(body, "mistral")
    # "[TOOL_CALLS]" is a special token: decoded, or "auto" would never see a call.
    assert body.skip_special_tokens is (choice != "auto")
    _, [call] = parse_text(plan.new_parser(), text)
    assert call.name == "f" and len(call.id) == 9 and call.id.isalnum()


def test_foreign_call_ids_take_mistrals_form_and_still_pair_up():
    from service.protocol.requests import ChatMessage
    from service.tool_calls.mistral import mistral_history_id
    from service.tool_calls.plan import template_messages

    body = msgspec.convert({"messages": [
        {"role": "user", "content": "Ping twice"},
        {"role": "assistant", "tool_calls": [
            {"id": "call_" + "a" * 20 + "x123456789", "type": "function",
             "function": {"name": "ping", "arguments": "{}"}},
            {"id": "call_" + "b" * 20 + "x123456789", "type": "function",
             "function": {"name": "ping", "arguments": "{}"}},
            {"id": "Ab3dE6gH9", "type": "function", "function": {"name": "ping", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_" + "b" * 20 + "x123456789", "content": "pong"},
        {"role": "tool", "tool_call_id": "call_" + "a" * 20 + "x123456789", "content": "pong"},
        {"role": "tool", "tool_call_id": "Ab3dE6gH9", "content": "pong"}]},
        type=dict[str, list[ChatMessage]])
    rendered = template_messages(body["messages"], None, True, "mistral")
    ids = [call["id"] for call in rendered[1]["tool_calls"]]
    assert all(len(i) == 9 and i.isalnum() for i in ids)
    assert ids[2] == "Ab3dE6gH9"  # already in Mistral's form: kept
    assert ids[0] != ids[1]  # the same last 9 characters: still two ids
    assert [m["tool_call_id"] for m in rendered[2:]] == [ids[1], ids[0], ids[2]]
    assert mistral_history_id("call_x") == mistral_history_id("call_x")
    other = template_messages(body["messages"], None, True, "hermes")
    assert other[1]["tool_calls"][0]["id"].startswith("call_")  # other formats: as sent
