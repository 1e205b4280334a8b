"""Who may ask, and what they may send: the checks a request passes before the front serves it.

The ``Host`` (a loopback bind answers only loopback names: DNS rebinding), the ``Origin`` (CORS, as
llama-server answers it: supervisor/api/cors.py), the API key (llama-server's: ``Authorization``,
Bearer optional, else ``X-Api-Key``), and the JSON body (at most ``server.max_body_bytes``, an
object).  :class:`Access` derives what it needs from the settings, and again when a reload swapped
them.
"""

from __future__ import annotations

import hmac
import json
import re
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
        self.cors = Cors(server.cors_origins)

    def update(self, server: ServerConfig) -> None:
        """Follow a reload: the keys and the origins of ``server``, if they are new settings."""
        if server is not self._for:
            self._for = server
            self._keys = [key.encode() for key in server.api_keys]
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
            # llama-server takes the key from Authorization (Bearer optional), else X-Api-Key.
            given = headers.get("authorization") or headers.get("x-api-key", "")
            token = (given[7:] if given[:7].lower() == "bearer " else given).strip().encode()
            # Compare against every key, so the time taken does not say which one nearly matched.
            matched = False
            for key in self._keys:
                matched |= hmac.compare_digest(token, key)
            if not matched:
                raise ClientError(
                    401, "invalid_api_key", "missing or wrong API key (Authorization: Bearer ..., or X-Api-Key)"
                )


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
