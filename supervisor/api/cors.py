"""Who may call onebitd from a browser page: CORS, as llama-server answers it (the origin rules the config
checks too are supervisor/config/origins.py).

llama-server (build 11434, tools/server/server-http.cpp) answers every request before routing:

- ``--cors-origins *`` (its default) with ``--cors-credentials`` (its default): the request's
  ``Origin`` is echoed in ``Access-Control-Allow-Origin``, whatever it is;
- ``--cors-origins localhost``: echoed only for an origin whose host is localhost, 127.0.0.1 or ::1
  (the default it takes when its tools or MCP servers are on);
- an ``OPTIONS`` preflight is answered at once, before the API key check (a browser sends no
  credentials with one), with ``Access-Control-Allow-Methods``/``-Headers``/``-Credentials``.

onebitd's ``server.cors_origins`` is a list of ``"*"``, ``"localhost"`` and exact origins
(``"https://app.example:8443"``); an origin is echoed when any entry allows it.  Its default is
``["localhost"]``: the cross-site guard onebitd always had on a loopback bind (a page on
evil.example may not make a browser post to it), which llama-server's default ``*`` does not keep.
"""

from __future__ import annotations

import attrs

from ..config.origins import ANY, LOOPBACK, host_of, is_loopback

# What onebitd serves, as llama-server's default list (DELETE: a resumable stream's stop).
ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
# How long a browser may reuse a preflight's answer (seconds): a reload changes cors_origins rarely.
MAX_AGE_S = 600


@attrs.frozen
class Cors:
    origins: tuple[str, ...] = (LOOPBACK,)

    def allows(self, origin: str) -> bool:
        wanted = origin.rstrip("/").lower()
        for entry in self.origins:
            if entry == ANY:
                return True
            if entry == LOOPBACK:
                if wanted != "null" and is_loopback(host_of(wanted)):
                    return True
            elif entry.rstrip("/").lower() == wanted:
                return True
        return False

    def headers(self, origin: str | None) -> list[tuple[str, str]]:
        """For every response: the allowed ``Origin`` echoed, as llama-server does with credentials."""
        if not origin or not self.allows(origin):
            return []
        return [
            ("Access-Control-Allow-Origin", origin),
            ("Access-Control-Allow-Credentials", "true"),
            ("Vary", "Origin"),
        ]

    def preflight(self, origin: str | None, requested_headers: str | None) -> list[tuple[str, str]]:
        """For an ``OPTIONS`` preflight, besides :meth:`headers`.  The requested headers are echoed:
        a ``*`` does not cover ``Authorization`` in a browser, and a credentialed request takes it
        literally."""
        if not origin or not self.allows(origin):
            return []
        return [
            ("Access-Control-Allow-Methods", ALLOW_METHODS),
            ("Access-Control-Allow-Headers", requested_headers or "*"),
            ("Access-Control-Max-Age", str(MAX_AGE_S)),
        ]
