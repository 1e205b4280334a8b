"""llama-server's web UI MCP proxy (``/cors-proxy``, with ``--ui-mcp-proxy``) through onebitd against
the real llama-server: a capturing HTTP target gets the same headers whether the client calls the
decoder's socket itself or onebitd, the ones the client names with ``x-llama-server-proxy-header-``
among them, and never the client's cookie, API key or proxy credentials."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import trio

from supervisor.testing import unix_transport
from tests.rigs.rig import make_config, real_llama_server, run_daemon

pytestmark = pytest.mark.real

DEADLINE_S = 240
SENT = {
    "authorization": "Bearer k",
    "cookie": "session=secret",
    "proxy-authorization": "Basic secret",
    "x-api-key": "k",
    "x-llama-server-proxy-header-accept": "application/json",
    "x-llama-server-proxy-header-authorization": "Bearer explicit",
    "x-llama-server-proxy-header-mcp-session-id": "s-1",
}


class Target(http.server.HTTPServer):
    heard: list[tuple[str, dict[str, str], bytes]]


class Capture(http.server.BaseHTTPRequestHandler):
    """Keeps every request's method and headers (names lower-case) in its server's ``heard``."""

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length)
        assert isinstance(self.server, Target)
        self.server.heard.append((self.command, {k.lower(): v for k, v in self.headers.items()}, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "11")
        self.end_headers()
        self.wfile.write(b'{"ok":true}')

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def capturing_target() -> Iterator[Target]:
    """An HTTP target on a free loopback port, served by a thread that is joined on the way out."""
    server = Target(("127.0.0.1", 0), Capture)
    server.heard = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


async def test_the_cors_proxys_target_gets_the_same_headers_through_onebitd_as_from_llama_server(
    short_dir: Path,
) -> None:
    real_llama_server()
    config = make_config(
        short_dir,
        server={"api_keys": ["k"]},
        decoder={"extra_args": ["--ui-mcp-proxy"]},
        model={"parallel": 1, "ctx_size": 512},
        hybrid={"enabled": False},
    )
    with capturing_target() as target, trio.fail_after(DEADLINE_S):
        url = quote(f"http://127.0.0.1:{target.server_port}/mcp?x=1", safe="")
        async with run_daemon(config) as running:
            transport = unix_transport(running.daemon.models.default.parts.launcher.socket)
            async with (
                httpx.AsyncClient(base_url=running.url, timeout=DEADLINE_S) as front,
                httpx.AsyncClient(transport=transport, base_url="http://decoder", timeout=DEADLINE_S) as direct,
            ):
                for method in ("GET", "POST"):
                    body = {"jsonrpc": "2.0", "id": 1, "method": "ping"} if method == "POST" else None
                    replies = []
                    for client in (direct, front):
                        reply = await client.request(method, f"/cors-proxy?url={url}", json=body, headers=SENT)
                        replies.append((reply.status_code, reply.content))
                    assert replies[0] == replies[1] == (200, b'{"ok":true}'), method
                    (m1, theirs, body1), (m2, mine, body2) = target.heard
                    target.heard.clear()
                    assert m1 == m2 == method
                    assert mine["accept"] == "application/json"
                    assert mine["authorization"] == "Bearer explicit"
                    assert mine["mcp-session-id"] == "s-1"
                    assert not {"cookie", "proxy-authorization", "x-api-key"} & set(mine)
                    assert not [name for name in mine if name.startswith("x-llama")]
                    if method == "GET":
                        assert mine == theirs
                        assert body1 == body2 == b""
                    else:
                        # onebitd relays the body as JSON it wrote again: its length may differ.
                        assert {**mine, "content-length": ""} == {**theirs, "content-length": ""}
                        assert json.loads(body1) == json.loads(body2) == body
