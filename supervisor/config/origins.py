"""Hosts and origins: which addresses ``server.host`` may name, which origins and hosts are onebitd's own
machine, and which ``server.cors_origins`` entries can be; the rules the config checks and the front's
CORS and Host checks share (supervisor/api/cors.py).
"""

from __future__ import annotations

import functools
import ipaddress
import json
import re
from urllib.parse import urlsplit

ANY = "*"
LOOPBACK = "localhost"
LOOPBACK_NAMES = {"localhost", "localhost.", "ip6-localhost"}


def is_loopback(host: str) -> bool:
    # Asked of every request's Host: the same few names, cached (a name longer than DNS allows,
    # which a client may send to fill the cache, is not).
    return _is_loopback(host) if len(host) <= 255 else _is_loopback.__wrapped__(host)


@functools.lru_cache(maxsize=256)
def _is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(value: str) -> str:
    """The host part of a Host header (``name:port``, ``[v6]:port``) or of an origin URL."""
    if "://" in value:
        try:
            return urlsplit(value).hostname or ""
        except ValueError:  # an origin that is no URL (``http://[``): no host anyone allows
            return ""
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def origin_problem(entry: str) -> str | None:
    """Why ``entry`` cannot be a ``server.cors_origins`` entry, or None."""
    if entry in (ANY, LOOPBACK, "null"):
        return None
    try:
        parts = urlsplit(entry)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        return f'expected "*", "localhost" or an origin like "https://app.example:8443", got {entry!r}'
    return None


def is_ip(host: str) -> bool:
    """An address literal (``[v6]`` brackets allowed): nothing to look up."""
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def host_problem(host: str) -> str | None:
    if is_ip(host):
        return None
    labels = host.rstrip(".").split(".")
    if host and len(host) <= 253 and all(LABEL.fullmatch(label) for label in labels):
        return None
    return f"expected an IP address or a host name, got {json.dumps(host)}"


LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
