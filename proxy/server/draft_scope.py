"""Whose earlier outputs a request may draft from: its tenant scope in the engine's draft cache.

``--draft-cache-scope`` sets how tenants are told apart:

- ``key``: by API key where keys are configured; without keys, by the request's ``user`` field;
  without either, one shared scope;
- ``user``: by the ``user`` field within each API key (the key alone where no ``user`` is sent);
- ``global``: one scope for everyone (drafts then depend on what others asked: the text stays
  exact, but acceptance and so latency do not);
- ``off``: no draft cache.

A request opts out with ``speculation: {"draft_cache": false}``. Keys are named by a digest, never
kept as they are.
"""

from __future__ import annotations

import hashlib


def key_identity(authorization: str | None) -> str | None:
    """A stable name for the bearer key of an ``Authorization`` header (None without one)."""
    if not authorization or " " not in authorization:
        return None
    token = authorization.split(" ", 1)[1].strip()
    return hashlib.sha256(token.encode()).hexdigest()[:16] if token else None


def draft_cache_scope(setting: str, key: str | None, user: str | None, wanted: bool | None = None) -> str | None:
    """The request's scope, or None where it does not use the draft cache. ``key``: the caller's
    key identity where the server checks keys (else None); ``user``: the request's ``user``
    field; ``wanted``: the request's ``speculation.draft_cache`` (None: as the server says)."""
    if setting == "off" or wanted is False:
        return None
    if setting == "global":
        return "global"
    tenant = f"key:{key}" if key else None
    if setting == "user" and user:
        return f"{tenant}/user:{user}" if tenant else f"user:{user}"
    if tenant:
        return tenant
    return f"user:{user}" if user else "shared"
