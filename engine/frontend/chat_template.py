"""Chat messages -> prompt token ids, through the model's own chat template.

One home for rendering, used by the offline `LLM.chat` and the HTTP chat route,
so both send the model exactly the same tokens for the same conversation:

    [{"role": "system", ...}, {"role": "user", ...}]
        -> tokenizer.apply_chat_template(tokenize=False)   "<|im_start|>system\\n…"
        -> tokenizer.encode(add_special_tokens=False)      [1, 9690, 198, …]

The template places the special tokens itself (BOS, role markers), so encoding
must not add them again. Tool definitions go to the template as its `tools`
variable, the name Hugging Face templates use; a template that never reads
that variable (SmolLM2's) cannot show them to the model (`renders_tools`).
"""

from __future__ import annotations

import inspect
from typing import Any

import jinja2
import jinja2.meta

from engine.errors import ValidationError


class ChatTemplateError(ValidationError):
    """The conversation cannot be rendered: no template, or the template refused it."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "messages")


def render_chat_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                     tools: list[dict] | None = None,
                     template_kwargs: dict[str, Any] | None = None) -> str:
    """The conversation as the model was trained to see it, as text.

    `template_kwargs` are more variables for the template (vLLM's
    chat_template_kwargs: Qwen3's `enable_thinking`); see check_template_kwargs.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model has no chat template: send a plain text prompt")
    extra = check_template_kwargs(tokenizer, template_kwargs)
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False,
            add_generation_prompt=add_generation_prompt, **extra,
        )
    except jinja2.TemplateError as exc:  # e.g. a template that insists roles alternate
        raise ChatTemplateError(f"the chat template refused these messages: {exc}") from None



def check_template_kwargs(tokenizer, template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """Template variables a request may set, refusing those that are not variables.

    apply_chat_template's own parameters (tokenize, chat_template, ...) and the
    names it fills itself (messages, tools) would change what is rendered and
    how, not what the template reads: a ValidationError names them. Any other
    name goes to the template, which reads it or not (as in vLLM).
    `enable_thinking`, which the reasoning parser reads too, must be a boolean.
    """
    if not template_kwargs:
        return {}
    reserved = {"messages", *inspect.signature(tokenizer.apply_chat_template).parameters}
    reserved.discard("kwargs")
    for name, value in template_kwargs.items():
        if name in reserved:
            raise ValidationError(f"chat_template_kwargs may not set {name!r}: it is not a "
                                  "template variable", f"chat_template_kwargs.{name}")
        if name == "enable_thinking" and not isinstance(value, bool):
            raise ValidationError(f"chat_template_kwargs.enable_thinking must be true or false, "
                                  f"got {value!r}", "chat_template_kwargs.enable_thinking")
    return template_kwargs


def chat_template_source(tokenizer) -> str:
    """The Jinja source of the template used with tools ("" without one).

    A tokenizer may carry named templates; with tools Hugging Face picks the
    one named "tool_use" where there is one.
    """
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    return template or ""


def renders_tools(tokenizer) -> bool:
    """Whether the chat template reads the `tools` variable at all.

    Read from the template's syntax tree, not by rendering: a template that
    never names `tools` drops tool definitions silently.
    """
    source = chat_template_source(tokenizer)
    if not source:
        return False
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateSyntaxError:  # a tag of Hugging Face's own: read the text
        return "tools" in source
    return "tools" in jinja2.meta.find_undeclared_variables(tree)
