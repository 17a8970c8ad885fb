"""What the server refused, as exceptions carrying its OpenAI-style error:

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

One class per status a caller may want to catch apart; StreamError for an
error that arrives inside a stream after it started (the status was 200).
"""

from __future__ import annotations

import msgspec


class APIError(Exception):
    """The server answered with an error. `status` is its HTTP status (200 for
    an error inside a stream)."""

    def __init__(self, status: int, message: str, type: str | None = None,
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(f"{status} {code or type or 'error'}: {message}")
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param


class BadRequestError(APIError):
    """400: invalid JSON, values out of range, a prompt too long."""


class AuthenticationError(APIError):
    """401 (no or bad API key) and 403 (a key without the right)."""


class NotFoundError(APIError):
    """404: unknown model or route."""


class RateLimitError(APIError):
    """429: too many requests wait; retried by the client before it gets here."""


class ServiceUnavailableError(APIError):
    """503: warming, draining or a dead engine; retried before it gets here."""


class StreamError(APIError):
    """An error event inside a stream that had started."""


class ConnectionError(APIError):  # noqa: A001 - the client's own, beside APIError
    """The server could not be reached, or the connection broke."""


BY_STATUS = {400: BadRequestError, 401: AuthenticationError, 403: AuthenticationError,
             404: NotFoundError, 429: RateLimitError, 503: ServiceUnavailableError}


class _Body(msgspec.Struct):
    message: str = ""
    type: str | None = None
    code: str | None = None
    param: str | None = None


class _Envelope(msgspec.Struct):
    error: _Body


def error_from(status: int, body: bytes, kind: type[APIError] | None = None) -> APIError:
    """The exception for an error answer (or event); a body that is not
    OpenAI's shape keeps its first bytes as the message."""
    kind = kind or BY_STATUS.get(status, APIError)
    try:
        error = msgspec.json.decode(body, type=_Envelope).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return kind(status, body[:500].decode("utf-8", "replace") or f"HTTP {status}")
    return kind(status, error.message, error.type, error.code, error.param)
