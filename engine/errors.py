"""A request the engine refuses, with the field at fault attached (as vLLM does).

The field travels as data, so the HTTP service can fill OpenAI's error
`param` from it; reading it back out of the message text breaks as soon as
a message starts with some other word.
"""

from __future__ import annotations


class ValidationError(ValueError):
    """A request field the engine cannot take.

    A ValueError, and str(exc) is the message alone, so callers that catch
    ValueError or match on the text see what they saw before. `param` is the
    request field's name as OpenAI's API spells it ("top_p", "prompt",
    "structured_outputs", "messages"), None when no one field is at fault.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
