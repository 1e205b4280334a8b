"""A client's hang-up: how it cancels the work done for it, and when it does not.

The server tells a hang-up itself where it can (supervisor/http/server.py's :class:`HangUp`, no task
per request); otherwise a task reads ``receive`` for ``http.disconnect``.  A hang-up cancels only
while the response is incomplete: what a request does after its last byte (the rest of the relay,
verification, bookkeeping) is the server's work, not the client's.

A stream sent with ``X-Conversation-Id`` whose decoder reply has begun is the exception: llama-server
goes on into the conversation's stream session for a replay (server-stream.cpp), so onebitd reads on,
the slot held, for at most ``server.detach_timeout_s`` (:func:`watch_disconnect`), then stops it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import attrs
import trio

from ..config import ServerConfig
from ..errors import ClientError, DecoderError
from ..http.respond import Receive, Responder
from ..http.server import HANG_UP, HangUp
from ..llama import decoder as decoder_api
from ..llama.decoder import DecoderClient
from .access import VISIBLE

log = logging.getLogger("onebit.front")

# The header that makes llama-server keep a stream in a session for a replay (server-stream.h).
CONVERSATION_HEADER = "X-Conversation-Id"
# A detached stream past server.detach_timeout_s is stopped with a DELETE, given this long.
STOP_TIMEOUT_S = 5.0


def hang_up_of(scope: dict[str, Any]) -> HangUp | None:
    """The server's hang-up watch for this request (supervisor/http/server.py), where it offers one."""
    extensions = scope.get("extensions") or {}
    hang_up: HangUp | None = extensions.get(HANG_UP)
    return hang_up


def conversation(headers: dict[str, str]) -> str | None:
    """The client's ``X-Conversation-Id``, to pass on; None without one."""
    value = headers.get(CONVERSATION_HEADER.lower())
    if value is None or not value.strip():
        return None
    value = value.strip()
    if not VISIBLE(value.replace(" ", "!")):
        raise ClientError(400, "bad_conversation_id", f"{CONVERSATION_HEADER} must be visible ASCII")
    return value


@contextmanager
def told_by_server(hang_up: HangUp, cancels: Callable[[str], bool]) -> Iterator[None]:
    """The block in a scope that the server's hang-up cancels, where ``cancels(why)`` says so."""
    with trio.CancelScope() as scope:

        def on_gone(why: str) -> None:
            if cancels(why):
                scope.cancel()

        hang_up.watch(on_gone)
        try:
            yield
        finally:
            hang_up.unwatch(on_gone)


@asynccontextmanager
async def hang_up_cancels(receive: Receive, hang_up: HangUp | None) -> AsyncIterator[None]:
    """The block in a scope that the client's hang-up cancels: told by the server where it can
    (``hang_up``), else found by a task reading ``receive``.  A body the block never read is the
    server's to drop."""
    if hang_up is not None:
        with told_by_server(hang_up, lambda why: True):
            yield
        return
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_cancel_on_hang_up, receive, nursery.cancel_scope)
        yield
        nursery.cancel_scope.cancel()


async def _cancel_on_hang_up(receive: Receive, scope: trio.CancelScope) -> None:
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except ClientError:
        pass  # a body that broke off (malformed, or past server.body_timeout_s): the client is gone too
    scope.cancel()


@attrs.define
class Watch:
    """What a request's hang-up watcher is given, and what it reports back."""

    scope: trio.CancelScope
    gone: list[str]  # a hang-up, with the server's reason where it gave one
    detached: list[bool]  # the hang-up left the stream to finish into its session
    conversation: str | None
    req: str
    client: DecoderClient  # the decoder of the model serving it, once known
    live: Callable[[], ServerConfig]  # the settings now: server.detach_timeout_s
    stopped: str | None = None  # why a detached stream was stopped, for the route line


async def watch_disconnect(receive: Receive, watch: Watch, out: Responder) -> None:
    """A client that hangs up cancels its request while the response is incomplete; one that took
    nothing for ``server.write_timeout_s`` is reported the same way, with why.

    A stream with a conversation id whose decoder reply has begun is left to run instead: its slot
    stays busy in the decoder whatever onebitd does, so the relay reads on, to the end, and holds
    onebitd's slot until then, for at most ``server.detach_timeout_s``.  Past that the stream is
    stopped as a client's ``DELETE /v1/stream`` stops it, and the request cancelled (the slot then
    settles as after any hang-up).  Before the reply began llama-server itself drops a request
    whose client left, and so does onebitd."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            watch.gone.append(message.get("reason", ""))
            if out.complete:
                return
            if watch.conversation is None or not out.streaming:
                watch.scope.cancel()
                return
            watch.detached.append(True)
            break
    timeout = watch.live().detach_timeout_s
    await trio.sleep(timeout)
    with trio.CancelScope(shield=True), trio.move_on_after(STOP_TIMEOUT_S):
        try:
            await decoder_api.delete_stream(watch.client, watch.conversation)
        except DecoderError as exc:
            log.warning("%s: stopping its detached stream failed: %s", watch.req, exc.message)
    watch.stopped = f"the detached stream ran past server.detach_timeout_s ({timeout:g}s); stopped"
    watch.scope.cancel()
