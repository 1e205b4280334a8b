"""Who may ask, and what they may send: the checks a request passes before the front serves it.

The ``Host`` (a loopback bind answers only loopback names: DNS rebinding), the ``Origin`` (CORS, as
llama-server answers it: supervisor/api/cors.py), the API key (llama-server's: ``Authorization``,
Bearer optional, else ``X-Api-Key``), the operator's rule for the status surface (below), and the
JSON body (at most ``server.max_body_bytes``, an object).  :class:`Access` derives what it needs
from the settings, and again when a reload swapped them.

The status surface (``/onebit/``, its files, ``/onebit/status``, ``/onebit/events``) shows pids,
paths and every client's request metadata, so it is the operator's (:meth:`Access.check_operator`):

==================  ==================================  ===================================
server.admin_keys   the page's files                    /onebit/status, /onebit/events
==================  ==================================  ===================================
empty               a loopback peer                     a loopback peer, with an API key
                                                        where server.api_keys is set
set                 anyone (they hold no data)          one of admin_keys, from anyone
==================  ==================================  ===================================

The peer is the TCP connection's: ``X-Forwarded-For`` is not read, so behind a reverse proxy on
the same host every client is loopback (docs/operations.md).  A refusal is 403 (``loopback_only``,
``admin_key_required``).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
from collections.abc import Sequence
from typing import Any

from ..config import ServerConfig
from ..config.origins import host_of, is_loopback
from ..errors import ClientError
from ..http.respond import Receive
from .cors import Cors

# What onebitd passes on of a client's query string or header: visible ASCII, as wire.py sends it.
VISIBLE = re.compile(r"[\x21-\x7e]*").fullmatch


class Access:
    """The checks of one bind: its loopback rule is the first settings' (the bind is made once);
    the keys and the origins are the settings' now (:meth:`update`)."""

    def __init__(self, server: ServerConfig) -> None:
        self._loopback_only = all(is_loopback(host) for host in server.host)
        self._for = server
        self._keys = [key.encode() for key in server.api_keys]
        self._admin_keys = [key.encode() for key in server.admin_keys]
        self.cors = Cors(server.cors_origins)

    def update(self, server: ServerConfig) -> None:
        """Follow a reload: the keys and the origins of ``server``, if they are new settings."""
        if server is not self._for:
            self._for = server
            self._keys = [key.encode() for key in server.api_keys]
            self._admin_keys = [key.encode() for key in server.admin_keys]
            self.cors = Cors(server.cors_origins)

    def check_host(self, headers: dict[str, str]) -> None:
        if self._loopback_only:
            # DNS rebinding: a page on evil.example resolving to 127.0.0.1 still sends its own Host.
            host = host_of(headers.get("host", ""))
            if host and not is_loopback(host):
                raise ClientError(403, "forbidden_host", f"Host {host!r} is not allowed on a loopback bind")

    def check_caller(self, method: str, public: bool, headers: dict[str, str]) -> None:
        """The origin of a request that changes something, and the key of one not ``public``."""
        origin = headers.get("origin")
        if method not in ("GET", "HEAD") and origin and not self.cors.allows(origin):
            # A browser sends a "simple" POST cross-site without asking first: CORS would only hide
            # the answer from the page, not stop the request.
            raise ClientError(403, "cross_origin", f"cross-site request from {origin!r} refused (server.cors_origins)")
        if self._keys and not public:
            self._api_key(headers)

    def _api_key(self, headers: dict[str, str]) -> int:
        which = key_index(self._keys, headers)
        if which is None:
            raise ClientError(
                401, "invalid_api_key", "missing or wrong API key (Authorization: Bearer ..., or X-Api-Key)"
            )
        return which

    def check_operator(self, peer: str | None, data: bool, headers: dict[str, str]) -> str:
        """A request for the status surface (``data``: its status or feed, else the page's files)
        from ``peer`` (the connection's address; None: unknown), by the rule in this module's
        docstring; who the client is, for the per-client bound on feeds (a key it was let in by,
        else its address)."""
        if self._admin_keys:
            if not data:
                return ""
            which = key_index(self._admin_keys, headers)
            if which is None:
                raise ClientError(
                    403,
                    "admin_key_required",
                    "the status page needs one of server.admin_keys (Authorization: Bearer ..., or X-Api-Key)",
                )
            return f"admin key {which + 1}"
        if not is_loopback_peer(peer):
            raise ClientError(
                403,
                "loopback_only",
                f"the status page answers loopback clients only, and {peer or 'this client'} is not one "
                "(server.admin_keys lets a client in by key)",
            )
        if data and self._keys:
            return f"API key {self._api_key(headers) + 1}"
        return str(peer)


def key_index(keys: Sequence[bytes], headers: dict[str, str]) -> int | None:
    """Which of ``keys`` the request bears, as llama-server takes one (Authorization, Bearer
    optional, else X-Api-Key); None: none of them."""
    given = headers.get("authorization") or headers.get("x-api-key", "")
    token = (given[7:] if given[:7].lower() == "bearer " else given).strip().encode()
    # Compare against every key, so the time taken does not say which one nearly matched.
    which = None
    for index, key in enumerate(keys):
        if hmac.compare_digest(token, key):
            which = index
    return which


def is_loopback_peer(peer: str | None) -> bool:
    """A connection's address (an IP address, never a name) is this machine's own."""
    try:
        address = ipaddress.ip_address(peer or "")
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback  # ::ffff:127.0.0.1, from a dual-stack socket
    return address.is_loopback


def check_method(method: str, *allowed: str) -> None:
    if method not in allowed:
        raise ClientError(405, "method_not_allowed", f"{method} is not allowed here; use {', '.join(allowed)}")


def target(path: str, query_string: bytes) -> str:
    """The path and query a relayed request asks of the decoder; the query must be visible ASCII."""
    query = query_string.decode("latin-1")
    if not VISIBLE(query):
        raise ClientError(400, "bad_query", "the query string must be visible ASCII (percent-encode the rest)")
    return f"{path}?{query}" if query else path


async def read_json(receive: Receive, headers: dict[str, str], limit: int) -> dict[str, Any]:
    """The request's body, a JSON object of at most ``limit`` bytes; ClientError otherwise."""
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ClientError(413, "body_too_large", f"request body over server.max_body_bytes ({limit})")
    chunks: list[bytes] = []
    size = 0
    # A body that stops coming: the server's receive() raises 408 past server.body_timeout_s.
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientError(499, "client_gone", "the client went away while sending its body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ClientError(413, "body_too_large", f"request body over server.max_body_bytes ({limit})")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ClientError(400, "bad_json", f"request body is not JSON: {exc}") from None
    except RecursionError:
        # json's C decoder recurses once per nesting level: a body of 100,000 "[" would raise
        # RecursionError through us (a 500) without this.
        raise ClientError(400, "bad_json", "request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ClientError(400, "bad_json", "request body must be a JSON object")
    return body
