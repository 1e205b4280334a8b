"""The requests relayed to a model as they are, on no slot of onebitd's (``RELAY`` endpoints):
answered whole, or, for a stream session's replay, chunk by chunk as the decoder makes it."""

from __future__ import annotations

import logging
from typing import Any

from ..errors import ClientError, DecoderError
from ..http import wire
from ..http.respond import Receive, Responder
from ..http.server import HangUp
from ..routes.relay import SSE_HEADERS, relay_reply, sse_error
from . import hangup
from .serving import Router

log = logging.getLogger("onebit.front")

# llama-server's MCP proxy (tools/server/server-cors-proxy.h) forwards a request header named with
# this prefix to its target under the name that follows it, and no other header of the client's.
PROXY_HEADER_PREFIX = "x-llama-server-proxy-header-"


def proxy_headers(headers: dict[str, str]) -> list[tuple[str, str]]:
    """The client's headers that llama-server's MCP proxy forwards to its target, still prefixed (the
    decoder strips the prefix), so the target gets what it gets from a client calling llama-server
    itself.  The rest stay here: the client's cookies, onebitd's API key, a proxy's credentials."""
    forwarded = []
    for name, value in headers.items():
        if name.startswith(PROXY_HEADER_PREFIX) and len(name) > len(PROXY_HEADER_PREFIX):
            if not wire.carries(name, value):
                raise ClientError(400, "bad_header", f"a proxy header onebitd cannot relay: {name}")
            forwarded.append((name, value))
    return forwarded


async def pass_through(
    router: Router, out: Responder, method: str, path: str, body: Any, headers: wire.Headers = ()
) -> None:
    """Relayed to the model the body names (the default one without a body, or a name), with
    ``headers`` besides onebitd's own (an MCP proxy request's :func:`proxy_headers`)."""
    asked = body.get("model") if isinstance(body, dict) else None
    # A relay that names no model (a GET: /props, /slots, a monitor's poll) loads none.
    async with router.use(asked, any_loaded=asked is None) as served:
        served.completions.check_ready()
        reply = await served.client.request(method, path, body, headers)
    await relay_reply(out, reply.status, reply.headers, reply.body)


async def relay_streamed(router: Router, out: Responder, path: str, receive: Receive, hang_up: HangUp | None) -> None:
    """A GET whose answer comes as it is made (a stream session's replay, which waits for the
    live bytes until the session ends, in the default model's decoder, which owns every
    conversation): relayed chunk by chunk; a client that hangs up closes the decoder's request,
    which ends the decoder's reading for it."""
    default = router.default
    default.completions.check_ready()
    async with (
        hangup.hang_up_cancels(receive, hang_up),
        default.client.stream(path, None, method="GET") as upstream,
    ):
        if upstream.status != 200:
            body = b"".join([chunk async for chunk in upstream.chunks])
            await relay_reply(out, upstream.status, upstream.headers, body)
        else:
            await out.start(200, SSE_HEADERS, source="decoder")
            try:
                async for chunk in upstream.chunks:
                    await out.body(chunk, more=True)
            except DecoderError as exc:
                log.warning("%s: the decoder stopped mid-replay: %s", path, exc.message)
                await out.body(sse_error(f"the decoder stopped mid-stream ({exc.public})"), more=True)
            await out.body(b"", more=False)
