"""Who may use ``/v1/cache`` and ``/metrics``: programs on this machine (or with the admin
token), never a web page.

mlx-lm answers every route with ``Access-Control-Allow-Origin: *`` and allows every
method, which is harmless for completions but would let any page the user visits read
``GET /v1/cache`` and send ``DELETE /v1/cache``. The admin route therefore

* sends no CORS headers and refuses preflights (``OPTIONS``): a browser blocks the
  cross-origin call before it is made;
* refuses a request whose ``Origin`` is not the server's own (a browser always sends
  ``Origin`` on a cross-origin ``GET`` and on every ``DELETE``);
* without a token, answers only clients on this machine's loopback interface — decided
  by the peer address of the connection, which a client cannot choose, not by the
  ``Host`` header, which it can (``recent`` holds text of other users' prompts) — and
  refuses a ``Host`` that is not this machine (an IP literal, ``localhost``, the bound
  host name or this host's name), so a DNS-rebinding page, which looks same-origin to the
  browser, is refused too;
* with ``--admin-token TOKEN`` requires ``Authorization: Bearer TOKEN`` (compared in
  constant time) from every client; the ``Host`` check is then left to the token
  (reverse proxies).

Programs such as ``curl`` send no ``Origin`` and are not affected.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
from dataclasses import dataclass, field
from typing import FrozenSet, Mapping, Optional, Tuple
from urllib.parse import urlsplit

#: Environment variable read when ``--admin-token`` is not given (keeps it out of ``ps``).
TOKEN_ENV = "MLX_KVCACHE_ADMIN_TOKEN"


def checked_token(token: str) -> str:
    """``token`` without surrounding white space; `ValueError` when nothing is left.

    An empty token is refused rather than kept: ``--admin-token "$TOKEN"`` with ``TOKEN``
    unset would otherwise make ``Authorization: Bearer`` with nothing after it the key."""
    token = token.strip()
    if not token:
        raise ValueError(f"the admin token is empty (an unset variable in a script?): give "
                         f"--admin-token / ${TOKEN_ENV} a secret, or leave both unset")
    return token


def _host_name(netloc: str) -> str:
    """``host`` of ``host[:port]`` / ``[v6][:port]``, lower case, without brackets."""
    netloc = netloc.strip().lower()
    if netloc.startswith("["):
        return netloc[1:netloc.find("]")] if "]" in netloc else netloc[1:]
    if netloc.count(":") == 1:
        return netloc.split(":", 1)[0]
    return netloc


def is_loopback(address: Optional[str]) -> bool:
    """Whether ``address`` (an IP literal, maybe IPv4-mapped or with a zone) is loopback."""
    if not address:
        return False
    try:
        ip = ipaddress.ip_address(str(address).split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def listens_beyond_loopback(bind_host: str) -> bool:
    """Whether a server bound to ``bind_host`` can be reached from other machines (a name
    counts as loopback only when every address it resolves to is)."""
    name = _host_name(bind_host) if bind_host else ""
    if not name:
        return True  # "" binds every interface
    if name == "localhost" or name.endswith(".localhost"):
        return False
    try:
        ipaddress.ip_address(name.split("%", 1)[0])
        return not is_loopback(name)
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(name, None)}
    except OSError:
        return True
    return not addresses or not all(is_loopback(a) for a in addresses)


def _local_names(bind_host: str) -> FrozenSet[str]:
    names = {"localhost", _host_name(bind_host)}
    try:
        names.add(socket.gethostname().lower())
        names.add(socket.getfqdn().lower())
    except OSError:  # pragma: no cover - no resolver
        pass
    return frozenset(n for n in names if n)


@dataclass(frozen=True)
class AdminPolicy:
    """The rules for ``/v1/cache`` (and ``/metrics``, which follows the same ones).

    Args:
        token: the admin token, or None (then only local ``Host`` names are accepted).
        bind_host: the ``--host`` the server listens on (its name counts as local).
    """

    token: Optional[str] = None
    bind_host: str = "127.0.0.1"
    names: FrozenSet[str] = field(default=frozenset(), compare=False)

    @classmethod
    def make(cls, token: Optional[str], bind_host: str) -> "AdminPolicy":
        """The policy for ``--admin-token`` ``token`` (None: ``$MLX_KVCACHE_ADMIN_TOKEN``
        if set) and ``--host`` ``bind_host``; `ValueError` for an empty token."""
        if token is None:
            token = os.environ.get(TOKEN_ENV)
        token = None if token is None else checked_token(token)
        return cls(token=token, bind_host=bind_host, names=_local_names(bind_host))

    def _local_host(self, host: str) -> bool:
        name = _host_name(host)
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            pass
        return name in self.names or name.endswith(".localhost")

    def refusal(self, method: str, headers: Mapping[str, str], peer: Optional[str] = None,
                route: str = "/v1/cache") -> Optional[Tuple[int, str, dict]]:
        """None when the request may proceed, else (status, message, extra headers).
        ``peer``: the client's address (the connection's, ``client_address[0]``); None
        only for callers that have no connection (then the headers decide alone).
        ``route``: the path the messages name."""
        if method == "OPTIONS":
            return 403, f"{route} does not answer cross-origin requests", {}
        host = headers.get("Host")
        origin = headers.get("Origin")
        if origin is not None:
            netloc = urlsplit(origin).netloc.lower() if origin != "null" else ""
            if not netloc or host is None or netloc != host.strip().lower():
                return 403, f"{route} does not answer requests from the origin {origin!r}", {}
        if self.token is not None:
            auth = headers.get("Authorization") or ""
            scheme, _, given = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    given.strip().encode(), self.token.encode()):
                return 401, f"{route} needs 'Authorization: Bearer <admin token>'", {
                    "WWW-Authenticate": 'Bearer realm="mlx-kvcache admin"'}
        elif peer is not None and not is_loopback(peer):
            return 403, (f"{route} answers clients on other machines only with an admin "
                         "token (start the server with --admin-token or "
                         f"${TOKEN_ENV})"), {}
        elif host is not None and not self._local_host(host):
            return 403, (f"{route} answers only requests addressed to this machine, not "
                         f"to {host!r} (use --admin-token behind a proxy)"), {}
        return None
