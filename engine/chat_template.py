"""Chat messages -> prompt token ids, through the model's own chat template.

One home for rendering, used by the offline `LLM.chat` and the HTTP chat route,
so both send the model exactly the same tokens for the same conversation:

    [{"role": "system", ...}, {"role": "user", ...}]
        -> tokenizer.apply_chat_template(tokenize=False)   "<|im_start|>system\\n…"
        -> tokenizer.encode(add_special_tokens=False)      [1, 9690, 198, …]

The template places the special tokens itself (BOS, role markers), so encoding
must not add them again.
"""

from __future__ import annotations

import jinja2


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: no template, or the template refused it."""


def render_chat_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The conversation as the model was trained to see it, as text."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model has no chat template: send a plain text prompt")
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except jinja2.TemplateError as exc:  # e.g. a template that insists roles alternate
        raise ChatTemplateError(f"the chat template refused these messages: {exc}") from None

