"""Which cache namespace a request is in (`cache.namespace`: clients kept apart), from
what it sends, in this order:

1. the body's ``cache_salt`` (chat, text completions, ``/v1/messages``,
   ``/v1/responses``; vLLM's name for it) — a non-empty string;
2. the ``X-Cache-Namespace`` header — the same values as ``cache_salt`` (one namespace);
3. with ``--cache-namespace-by api-key``: the API key (``Authorization: Bearer KEY`` or
   ``x-api-key: KEY``), hashed — the key itself is never kept, logged or stored.

Clients that send none of these share the cache as before. A salt is a secret the
clients that may share a cache agree on; an API key's namespace cannot be joined by a
salt (the two are kept apart).
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, Optional

__all__ = ["HEADER", "MAX_SALT", "request_namespace", "sharing_note"]

#: The header that names a namespace.
HEADER = "X-Cache-Namespace"
#: The longest ``cache_salt`` or header value taken (characters).
MAX_SALT = 1024


def _salt(value: Any, where: str) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where} must be a non-empty string")
    if len(value) > MAX_SALT:
        raise ValueError(f"{where} must be at most {MAX_SALT} characters")
    return "salt:" + value


def _api_key(headers: Mapping[str, str]) -> Optional[str]:
    auth = headers.get("Authorization") or ""
    key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    key = key or (headers.get("x-api-key") or "").strip()
    return key or None


def request_namespace(body: Any, headers: Mapping[str, str], by_api_key: bool = False
                      ) -> Optional[str]:
    """The namespace of a request with JSON ``body`` and ``headers`` (None: the shared
    cache). Raises `ValueError` naming the field for a ``cache_salt`` or header that is
    not a non-empty string of at most `MAX_SALT` characters."""
    if isinstance(body, dict):
        salt = _salt(body.get("cache_salt"), "cache_salt")
        if salt is not None:
            return salt
    salt = _salt(headers.get(HEADER) or None, f"the {HEADER} header")  # (empty: none)
    if salt is not None:
        return salt
    if by_api_key:
        key = _api_key(headers)
        if key is not None:
            return "key:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    return None


def sharing_note(by: str, beyond_loopback: bool) -> str:
    """What the start log says of who shares the cache under ``--cache-namespace-by
    by`` (``request`` or ``api-key``), for a server reached beyond loopback or not."""
    if by == "api-key":
        return ("each API key has a cache namespace of its own (Authorization: Bearer / "
                "x-api-key; a cache_salt or X-Cache-Namespace names one too); requests with "
                "none of these share one cache")
    who = "all clients, on other machines too," if beyond_loopback else "all clients"
    return (f"{who} share one cache unless a request names a namespace (cache_salt, "
            f"X-Cache-Namespace): a client can tell from cached_tokens and answer times how "
            f"much of its prompt another client sent before. --cache-namespace-by api-key "
            f"gives each API key its own")
