"""Tenancy in the prefix cache: a request's cache salt, per API key, then the client's."""

from __future__ import annotations

import hashlib

from service.config import ServiceConfig


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
