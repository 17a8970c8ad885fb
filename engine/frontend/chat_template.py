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

import jinja2
import jinja2.meta


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: no template, or the template refused it."""


def render_chat_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                     tools: list[dict] | None = None) -> str:
    """The conversation as the model was trained to see it, as text."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model has no chat template: send a plain text prompt")
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
    except jinja2.TemplateError as exc:  # e.g. a template that insists roles alternate
        raise ChatTemplateError(f"the chat template refused these messages: {exc}") from None



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
