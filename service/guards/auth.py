"""The guard before every route: API keys, the request-body limit and deadline, refusal pacing.

One pure ASGI middleware does the checks that come before any route runs,
and holds back refusals of a client that keeps being refused
(service/guards/pacing.py), whichever layer refuses:

    request ──► its client's refusals past the most that may wait         ──► 429
            ──► body limit (Content-Length, then bytes as they arrive) ──► 413
            ──► body not complete within --body-timeout-seconds          ──► 408
            ──► API key (Bearer, constant-time)                          ──► 401
            ──► the app

Keys are compared with hmac.compare_digest against every configured key, so
the time taken does not reveal how much of a guess was right.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from service.config import ServiceConfig
from service.errors import (ERROR_TO_COUNT, APIError, count_error, count_paced, counting_send,
                            error_response)
from service.guards.limits import limited, too_large
from service.guards.pacing import RefusalPacer, client_of, too_many_refusals

# Probes and scrapers reach these without a key unless the config says otherwise.
OPEN_PATHS = frozenset({"/health", "/live", "/metrics", "/get_server_info"})
# Names the sockets that carry every tenant's prompt tokens: any key once keys
# are set, unless --open-kv-event-sources (a discovering router holds no key).
KV_EVENT_SOURCES = "/kv_event_sources"
# The web page and the schema hold no secrets.
PUBLIC_PATHS = frozenset({"/", "/openapi.json", "/favicon.ico"})
PUBLIC_PREFIXES = ("/web/",)  # the chat page's own files
# Routes that act on every tenant at once: an admin key only (once any key is set).
ADMIN_PATHS = frozenset({"/reset_prefix_cache"})
# vLLM's run-time LoRA routes, admin too; only where they exist (else a plain 404).
RUNTIME_LORA_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def find_key(keys: tuple[str, ...], headers: Headers) -> str | None:
    """The key of `keys` this request presents, or None."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    token = token.strip()
    found = None
    for key in keys:  # no early exit: every key costs the same time
        if hmac.compare_digest(token.encode(), key.encode()):
            found = key
    return found


class Guard:
    def __init__(self, app: ASGIApp, config: ServiceConfig) -> None:
        self.app = app
        self.config = config
        self.pacer = RefusalPacer(config.refusal_rate, config.refusal_burst)
        self.admin_paths = ADMIN_PATHS | (RUNTIME_LORA_PATHS if config.allow_runtime_lora_updating
                                          else frozenset())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        keys = self.config.api_keys + self.config.admin_keys
        key = find_key(keys, headers) if keys else None
        client = client_of(scope, key)
        app = scope.get("app")
        # A client refused past its debt is refused whole, before any work; not
        # its probes: a router whose health checks shared a flooder's bucket
        # would drop every replica.
        retry_after = 0.0 if scope["path"] in OPEN_PATHS else self.pacer.retry_after(client)
        if retry_after > 0:
            error = too_many_refusals(retry_after)
            count_error(app, error)
            await error_response(error)(scope, receive, send)
            return
        # Error answers are counted as they are sent, after pacing: a refusal it
        # replaces with a 429 counts as the 429 alone.
        state = scope.setdefault("state", {})
        send = self.pacer.paced_send(client, counting_send(app, state, send),
                                     lambda: count_paced(app),
                                     lambda error: count_error(app, error))
        limit = self.config.max_request_body_bytes
        error = self._check_length(headers, limit) or self._check_key(scope, key)
        if error is not None:
            state[ERROR_TO_COUNT] = error
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, limited(receive, limit, self.config.body_timeout_seconds), send)

    @staticmethod
    def _check_length(headers: Headers, limit: int) -> APIError | None:
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return too_large(limit)
        return None

    def _check_key(self, scope: Scope, key: str | None) -> APIError | None:
        """401 without a valid key; 403 for an admin route without an admin key.

        With no key configured at all the server is open (a laptop); an admin
        key is also an API key on the other routes, a tenant of its own.
        """
        config, path = self.config, scope["path"]
        keys = config.api_keys + config.admin_keys
        if not keys or path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES):
            return None
        is_open = path in OPEN_PATHS or (path == KV_EVENT_SOURCES
                                         and config.open_kv_event_sources)
        if is_open and not config.protect_health_and_metrics:
            return None
        if key is None:
            return APIError(
                401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        if path in self.admin_paths and key not in config.admin_keys:
            return APIError(
                403, f"{path} acts on every tenant: it needs an admin key (--admin-key)",
                code="admin_key_required",
            )
        scope.setdefault("state", {})["api_key"] = key
        return None
