"""Every failure becomes OpenAI's error shape with the right status code.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": null}}

Handlers raise `APIError`; malformed bodies surface as msgspec errors; what
the engine refuses as its ValidationError, which names the field; unknown
routes as starlette's HTTPException. All of them end here, so no client ever
sees a starlette HTML page or a Python traceback.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Send

from engine.errors import ValidationError
from service.protocol.replies import ErrorInfo, ErrorResponse, encoder

logger = logging.getLogger(__name__)

# OpenAI's `type` for each status we send.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error")
        return ErrorResponse(ErrorInfo(self.message, kind, self.param, self.code))


class ClientGone(Exception):
    """The client hung up before its request was read: nobody to answer, nothing to log."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# msgspec reports where validation failed as a JSON path: "... - at `$.messages[0].role`".
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


# ... and a field a request type does not have (forbid_unknown_fields) by its name.
_UNKNOWN = re.compile(r"^Object contains unknown field `(.*)`$", re.S)


def from_validation_error(exc: msgspec.ValidationError) -> APIError:
    text = str(exc)
    match = _PATH.search(text)
    param = match.group(1) or None if match else None
    message = _PATH.sub("", text)
    unknown = _UNKNOWN.match(message)
    if unknown is not None:  # OpenAI's answer to an option it does not have
        field = f"{param}.{unknown.group(1)}" if param else unknown.group(1)
        return bad_request(f"Unknown parameter: {field!r}. This server does not serve it.",
                           param=field, code="unknown_parameter")
    return bad_request(f"{message} (at {param})" if param else message, param=param)


def from_engine_error(exc: ValidationError, fields: Mapping[str, str] | None = None) -> APIError:
    """The engine's refusal as a 400 whose `param` is the field the error carries.

    The engine names fields as a completion request spells them; `fields` maps
    those a route spells otherwise (chat sends its prompt as "messages"). The
    message text is never read for the field: it may start with any word.
    """
    param = exc.param
    if fields and param in fields:
        param = fields[param]
    return bad_request(exc.message, param=param)


def from_decode_error(exc: Exception) -> APIError:
    """msgspec's DecodeError, or what it lets through: bad UTF-8, too deep a nesting."""
    if isinstance(exc, RecursionError):
        reason = "it is nested too deeply"
    elif isinstance(exc, UnicodeDecodeError):
        reason = f"it is not valid UTF-8 ({exc.reason} at byte {exc.start})"
    else:
        reason = str(exc)
    return bad_request(f"the request body is not valid JSON: {reason}", code="invalid_json")


def error_response(error: APIError) -> Response:
    return Response(
        encoder.encode(error.body()),
        status_code=error.status,
        media_type="application/json",
        headers=error.headers,
    )


def _metrics(app):
    """The app's metrics, or None before it serves."""
    state = getattr(getattr(app, "state", None), "service", None)
    return None if state is None else state.metrics


def count_error(app, error: APIError) -> None:
    """Count an error answer in the app's metrics (http_errors_total)."""
    metrics = _metrics(app)
    if metrics is not None:
        metrics.count_error(error.status, error.code)


def count_paced(app) -> None:
    """Count a refusal held back by pacing (refusals_paced_total)."""
    metrics = _metrics(app)
    if metrics is not None:
        metrics.refusals_paced.inc()


# Where the guard keeps a request's error answer until it is sent (scope state):
# pacing may send a 429 in its place, and an answer is counted once, as sent.
ERROR_TO_COUNT = "error_to_count"


def counted_response(request: Request, error: APIError) -> Response:
    """The error's answer, counted when it goes out: by the guard's send when the
    request passed it (only what is sent counts: a refusal pacing replaced by a
    429 is not counted too), else now."""
    state = request.scope.get("state")
    if state is not None and ERROR_TO_COUNT in state:
        state[ERROR_TO_COUNT] = error
    else:
        count_error(request.app, error)
    return error_response(error)


def counting_send(app, state: dict, send: Send) -> Send:
    """`send` that counts the request's error answer (state[ERROR_TO_COUNT]) as
    its status goes out, if that status is the error's own."""
    state[ERROR_TO_COUNT] = None

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            error, state[ERROR_TO_COUNT] = state[ERROR_TO_COUNT], None
            if error is not None and error.status == message["status"]:
                count_error(app, error)
        await send(message)

    return wrapped


async def handle_api_error(request: Request, exc: APIError) -> Response:
    return counted_response(request, exc)


async def handle_engine_error(request: Request, exc: ValidationError) -> Response:
    # A refusal no route caught itself: still a 400 naming the engine's field.
    return counted_response(request, from_engine_error(exc))


async def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        message, code = f"no route {request.method} {request.url.path}", "not_found"
    else:
        message, code = exc.detail, None
    return counted_response(request, APIError(exc.status_code, message, code=code,
                                              headers=exc.headers))


async def handle_client_gone(request: Request, exc: ClientGone) -> Response:
    # 499 (nginx's "client closed request") is never seen by the client; it
    # only keeps the access log honest.
    return Response(status_code=499)


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    error = APIError(500, f"internal error: {type(exc).__name__}")
    count_error(request.app, error)  # answered outside the guard, which would count it
    return error_response(error)


EXCEPTION_HANDLERS = {
    APIError: handle_api_error,
    ClientGone: handle_client_gone,
    ValidationError: handle_engine_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
