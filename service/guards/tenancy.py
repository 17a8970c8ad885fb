"""Tenancy: a request's prefix-cache salt (per API key, then the client's) and the
priorities a key may ask for."""

from __future__ import annotations

import hashlib

from service.config import ServiceConfig
from service.errors import APIError


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


def check_priority_floor(config: ServiceConfig, api_key: str | None, priority: int) -> None:
    """403 for a priority more urgent than --min-priority-non-admin from a request
    that holds no admin key, once any key is set.

    Refused, not clamped: a clamped request would run later than its sender
    believes, and the 403 names the field, so a client learns its limit at once.
    Without keys there are no tenants to protect from one another.
    """
    floor = config.min_priority_non_admin
    if priority >= floor or not (config.api_keys or config.admin_keys):
        return
    if api_key is not None and api_key in config.admin_keys:
        return
    raise APIError(403, f"priority {priority} is more urgent than this key may ask for: "
                   f"without an admin key, priority must be >= {floor} "
                   "(--min-priority-non-admin)", param="priority",
                   code="priority_not_allowed")
