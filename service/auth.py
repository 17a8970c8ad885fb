"""API keys, tenant salts for the prefix cache, and the request-body limit.

One pure ASGI middleware does the checks that come before any route runs:

    request ──► body limit (Content-Length, then bytes as they arrive) ──► 413
            ──► API key (Bearer, constant-time)                          ──► 401
            ──► the app

Keys are compared with hmac.compare_digest against every configured key, so
the time taken does not reveal how much of a guess was right.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.config import ServiceConfig
from service.errors import APIError, error_response

# Probes and scrapers reach these without a key unless the config says otherwise.
OPEN_PATHS = frozenset({"/health", "/metrics"})
# The web page and the schema hold no secrets.
PUBLIC_PATHS = frozenset({"/", "/openapi.json", "/favicon.ico"})


def find_key(config: ServiceConfig, headers: Headers) -> str | None:
    """The configured key this request presents, or None."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    token = token.strip()
    found = None
    for key in config.api_keys:  # no early exit: every key costs the same time
        if hmac.compare_digest(token.encode(), key.encode()):
            found = key
    return found


def cache_salt(config: ServiceConfig, api_key: str | None, client_salt: str | None) -> str | None:
    """The prefix-cache salt for a request: the tenant's, then the client's on top.

    A tenant is an API key. Its salt is derived here, on the server, so a
    client cannot claim another tenant's cache by sending that tenant's salt;
    a client salt only splits a tenant's cache further.
    """
    tenant = ""
    if api_key is not None and not config.share_prefix_cache_across_keys:
        tenant = hashlib.sha256(b"pagedserve-tenant\0" + api_key.encode()).hexdigest()
    if not tenant and not client_salt:
        return None
    return f"{tenant}\0{client_salt or ''}"


class Guard:
    def __init__(self, app: ASGIApp, config: ServiceConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        limit = self.config.max_request_body_bytes
        error = self._check_length(headers, limit) or self._check_key(scope, headers)
        if error is not None:
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, _limited(receive, limit), send)

    @staticmethod
    def _check_length(headers: Headers, limit: int) -> APIError | None:
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return too_large(limit)
        return None

    def _check_key(self, scope: Scope, headers: Headers) -> APIError | None:
        path = scope["path"]
        if not self.config.api_keys or path in PUBLIC_PATHS:
            return None
        if path in OPEN_PATHS and not self.config.protect_health_and_metrics:
            return None
        key = find_key(self.config, headers)
        if key is None:
            return APIError(
                401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        scope.setdefault("state", {})["api_key"] = key
        return None


def too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body is larger than the limit of {limit} bytes",
        code="request_too_large",
    )


def _limited(receive: Receive, limit: int) -> Receive:
    """`receive` that raises 413 once more than `limit` body bytes arrived (chunked bodies)."""
    received = 0

    async def wrapped() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise too_large(limit)
        return message

    return wrapped
