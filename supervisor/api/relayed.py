"""The requests relayed to a model as they are, on no slot of onebitd's (``RELAY`` endpoints):
answered whole, or, for a stream session's replay, chunk by chunk as the decoder makes it."""

from __future__ import annotations

import logging
from typing import Any

from ..errors import DecoderError
from ..http.respond import Receive, Responder
from ..http.server import HangUp
from ..routes.relay import SSE_HEADERS, relay_reply, sse_error
from . import hangup
from .serving import Router

log = logging.getLogger("onebit.front")


async def pass_through(router: Router, out: Responder, method: str, path: str, body: Any) -> None:
    """Relayed to the model the body names (the default one without a body, or a name)."""
    asked = body.get("model") if isinstance(body, dict) else None
    # A relay that names no model (a GET: /props, /slots, a monitor's poll) loads none.
    async with router.use(asked, any_loaded=asked is None) as served:
        served.completions.check_ready()
        reply = await served.client.request(method, path, body)
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
