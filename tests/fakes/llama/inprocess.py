"""The fake llama-server in this process: the core (tests/fakes/llama/core.py) as an httpx handler,
handed to ``DecoderClient`` as its transport through :class:`HttpxWire`, so onebitd talks to it
without a process (httpx's ``MockTransport`` is the model).  ``Completions``, ``Front`` and the handoffs
are tested against it; tests/fakes/llama/process.py runs the same core as a program for what only a
process shows (crashes, restarts, signals, fd passing).

It is a stock llama-server (no ``?action=share``) with ``state_dir`` as its slot save path, steered by
swapping its frozen :class:`~tests.fakes.llama.core.Modes` (``fake.modes = Modes(restore_refuse=True)``).
Where the core pauses (``hang``, ``hold``, ``hold_save``, ``hold_restore``, a live replay), it waits for
``release``, once set for good.  What it was asked is kept (``seen``, ``heard``, ``headed``), and what
it did (``records``: the core's log records; ``requests`` and ``actions`` read from them).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qs

import attrs
import httpx
import trio

from supervisor.errors import DecoderUnavailable
from supervisor.http import wire
from supervisor.llama.decoder import DecoderClient

from .core import Core, Modes, Settings, tokenize
from .steps import After, Answer, Chunk, Head, Pause, Sleep, Step, Whole


@attrs.frozen
class Request:
    """One completion the fake served, as it arrived, for tests to read."""

    path: str
    slot: int
    prompt: list[int]
    prompt_n: int
    cache_n: int


SLOT_ACTIONS = ("save", "restore", "erase", "share", "adopt")


@attrs.define
class FakeLlama:
    state_dir: Path
    n_slots: int = 2
    alias: str = "fake-model"
    modes: Modes = attrs.Factory(Modes)
    n_ctx_slot: int | None = None  # a slot's context: a prompt that leaves no room is refused
    records: list[dict[str, Any]] = attrs.Factory(list)  # the core's log, in order
    seen: list[tuple[str, str, Any]] = attrs.Factory(list)  # (path, query, body) of every request
    heard: list[tuple[str, str, str | None]] = attrs.Factory(list)  # (method, path, X-Conversation-Id)
    headed: list[tuple[str, dict[str, str]]] = attrs.Factory(list)  # (path, headers) of every request
    release: trio.Event = attrs.Factory(trio.Event)  # ends every pause, once set
    core: Core = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        settings = Settings(self.n_slots, self.n_ctx_slot, self.alias, slot_save_path=str(self.state_dir))
        self.core = Core(settings, lambda: self.modes, self.records.append)

    tokenize = staticmethod(tokenize)

    def client(self) -> DecoderClient:
        """A DecoderClient whose transport is this fake."""
        return DecoderClient(self.state_dir / "unused.sock", transport=HttpxWire(httpx.MockTransport(self.handle)))

    def with_slot_context(self, n_ctx: int) -> None:
        """The fake as started with a slot context of ``n_ctx`` (its slots as they were)."""
        self.n_ctx_slot = n_ctx
        self.core.settings = Settings(self.n_slots, n_ctx, self.alias, slot_save_path=str(self.state_dir))

    @property
    def slots(self) -> list[list[int]]:
        """Each slot's cells, as tokens."""
        return self.core.cache

    @property
    def requests(self) -> list[Request]:
        found = [r for r in self.records if r["event"] == "arrived"]
        return [Request(r["path"], r["slot"], r["tokens"], r["prompt_n"], r["cache_n"]) for r in found]

    @property
    def actions(self) -> list[tuple[str, int]]:
        """(action, slot) of every slot action, in order."""
        return [(r["event"], r["slot"]) for r in self.records if r["event"] in SLOT_ACTIONS]

    # -- the transport ------------------------------------------------------------------------------

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path, query = request.url.path, request.url.query.decode()
        self.seen.append((path, query, json.loads(request.content) if request.content else {}))
        self.heard.append((request.method, path, request.headers.get("x-conversation-id")))
        self.headed.append((path, dict(request.headers)))
        asked = {name: values[-1] for name, values in parse_qs(query).items()}
        steps = self.core.answer(request.method, path, asked, request.content)
        try:
            for step in steps:
                if isinstance(step, Whole):
                    for after in steps:  # the effects after a whole reply, before it is handed back
                        await self._run(after)
                    headers = {"content-type": step.content_type}
                    return httpx.Response(step.status, content=step.body, headers=headers)
                if isinstance(step, Head):
                    headers = {"content-type": step.content_type}
                    return httpx.Response(step.status, headers=headers, stream=Events(self._rest(steps)))
                await self._run(step)
        except BaseException:
            steps.close()
            raise
        raise AssertionError(f"the fake's answer to {path} ended without a reply")

    async def _rest(self, steps: Answer) -> AsyncGenerator[bytes, None]:
        """A streamed reply's chunks; closing it (a client that left) closes the answer."""
        try:
            for step in steps:
                if isinstance(step, Chunk):
                    yield step.data
                else:
                    await self._run(step)
        finally:
            steps.close()

    async def _run(self, step: Step) -> None:
        if isinstance(step, Pause):
            if step.held():
                await self.release.wait()
        elif isinstance(step, Sleep):
            await trio.sleep(step.seconds)
        elif isinstance(step, After):
            await trio.to_thread.run_sync(step.effect)
        else:
            raise AssertionError(f"a step out of place: {step}")


class Events(httpx.AsyncByteStream):
    """A streamed reply whose close is a checkpoint, as releasing a real connection is.  Its own
    iterator, not an async generator: a reply abandoned mid-way (a client that hung up) is closed
    by ``aclose``, and leaves no generator for the garbage collector to find unfinished."""

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        self._events = events

    def __aiter__(self) -> Events:
        return self

    async def __anext__(self) -> bytes:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        await self._events.aclose()
        await trio.lowlevel.checkpoint()


class HttpxWire:
    """An httpx transport as the decoder client's :class:`~supervisor.http.wire.Transport`: what the fakes
    here are written against (handlers that take an ``httpx.Request``), with httpx's errors turned
    into onebit's as supervisor/http/wire.py turns the socket's."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def send(self, method: str, path: str, body: bytes | None, extra: wire.Headers = ()) -> wire.Response:
        headers = {} if body is None else {"content-type": "application/json"}
        headers.update(extra)
        request = httpx.Request(method, "http://decoder" + path, content=body, headers=headers)
        try:
            response = await self.inner.handle_async_request(request)
        except httpx.HTTPError as exc:
            raise DecoderUnavailable(f"decoder {method} {path}: {type(exc).__name__}: {exc}") from exc

        async def chunks() -> AsyncGenerator[bytes, None]:
            if response.is_stream_consumed:  # a body given whole is read at once
                yield response.content
                return
            try:
                async with aclosing(cast(AsyncGenerator[bytes, None], response.aiter_raw())) as raw:
                    async for chunk in raw:
                        yield chunk
            except httpx.HTTPError as exc:
                raise DecoderUnavailable(f"decoder stream {path}: {type(exc).__name__}: {exc}") from exc

        return wire.Response(response.status_code, dict(response.headers), chunks, response.aclose)

    async def aclose(self) -> None:
        await self.inner.aclose()
