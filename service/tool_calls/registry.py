"""The tool-call formats by name (--tool-call-parser); each parser reads generated text
into tool calls, incrementally, so a stream can carry them as deltas.

A parser is fed the text of one choice piece by piece (each engine update's
delta) and answers what of it is plain content and what belongs to tool calls:

    feed('[{"name": "get_w')              -> nothing yet (the name is not complete)
    feed('eather", "arguments": {"ci')    -> call 0 opens: id, name "get_weather", '{"ci'
    feed('ty": "Paris"}}]')               -> call 0 arguments '{"ci' ... 'ty": "Paris"}'
    finish()                              -> whatever was held back

The same parser reads a whole response at once (`parse_text`), so a streamed
and an unstreamed answer cannot disagree.

Five formats, one module each:
  ArgumentsParser  arguments.py: a named tool_choice: the whole output is that
                   function's arguments (the grammar allowed nothing else).
  CallListParser   call_list.py: tool_choice "required": a JSON list of {"name",
                   "arguments"} objects, held to that shape by the grammar (plan.py).
  HermesParser     hermes.py: tool_choice "auto" for Hermes-style templates
                   (Qwen2.5 and Qwen3, Hermes 2 and 3, SmolLM3): free text, with
                   each call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
  Llama3JsonParser llama3_json.py: tool_choice "auto" for Llama 3.1-3.3 templates:
                   the whole reply is {"name": ..., "parameters": {...}} (several
                   joined by ";"), optionally after <|python_tag|>; anything else
                   is content.
  MistralParser    mistral.py: tool_choice "auto" for Mistral templates: content,
                   then [TOOL_CALLS] and a JSON list of calls (or name[ARGS]{...}).
The "auto" formats are the model's own and unconstrained: a call whose JSON
does not parse is returned as content, never dropped.
"""

from __future__ import annotations

from service.tool_calls.base import ToolCallParser
from service.tool_calls.hermes import HermesParser
from service.tool_calls.llama3_json import Llama3JsonParser
from service.tool_calls.mistral import MistralParser

# The model's own formats, for tool_choice "auto", by the names --tool-call-parser takes.
FORMATS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}
PARSERS = tuple(FORMATS)


def auto_parser(name: str, max_calls: int | None) -> ToolCallParser:
    return FORMATS[name](max_calls)


def detect_parser(chat_template: str, configured: str) -> str | None:
    """The tool-call format for tool_choice "auto": the configured one, or the template's.

    "auto" reads the template: Hermes-style templates write "<tool_call>",
    Llama 3's "<|python_tag|>", Mistral's "[TOOL_CALLS]". None: no known format,
    so "auto" is refused.
    """
    if configured == "none":
        return None
    if configured in PARSERS:
        return configured
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template:
        return "llama3_json"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    return None
