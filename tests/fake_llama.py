"""An in-process fake llama-server: an httpx handler, handed to ``DecoderClient`` as its transport
through :class:`HttpxWire`, so onebitd talks to it without a process (httpx's ``MockTransport`` is
the model).  ``Completions``, ``Front`` and the handoffs are
tested against it; tests/fake_decoder.py stays for what only a process shows (crashes, restarts,
signals, fd passing).

It speaks the same dialect as tests/fake_decoder.py and reuses its pieces (tokens are words, a
reply echoes the prompt's last words, ``timings`` and ``usage`` as llama-server puts them), and it is
steered the same way: by that module's :class:`~tests.fake_decoder.Modes`, the one set of mode names
every fake decoder understands (``fake.modes = Modes(restore_refuse=True)``).

Beyond the completions it answers the other endpoints onebitd relays in llama-server's shapes, as a
decoder started without ``--embeddings``/``--reranking`` does: ``GET /props``, ``/slots``,
``/v1/models``, ``/models``, ``/lora-adapters``, ``/metrics``; ``POST /v1/messages/count_tokens``;
embeddings and rerank 501.  ``POST /v1/messages`` and ``/v1/responses`` (whole or streamed, in
Anthropic's and the Responses API's shapes, with their ``usage``) are completions on a slot like
chat's: converted as llama-server converts them (supervisor/llama/chatform.py, as patched: ``id_slot``
kept) and templated as chat is.  ``seen`` keeps every request's path, query and body, for tests to
see what onebitd asked.

The slot cache is llama-server's: a slot holding a prefix of the prompt evaluates only the rest (at
least one token; under ``modes.recurrent`` a slot holds the reply too and nothing is cut back, as a
hybrid model's state), a restore fills the slot from a ``{"fake_state": true, "tokens": [...]}`` file in
``state_dir``, an erase empties it.  ``?action=share`` answers 400 as a stock llama-server does.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qs

import attrs
import httpx
import trio

from supervisor.errors import ChatFormRefused, DecoderUnavailable
from supervisor.http import wire
from supervisor.llama import chatform
from supervisor.llama.decoder import DecoderClient
from supervisor.llama.statefile import MAGIC_BYTES as STATE_MAGIC

from . import fake_decoder
from .fake_decoder import HttpError, Modes, chatml, content_text, parse_job, token_id

COMPLETIONS = ("/completion", "/v1/completions", "/v1/chat/completions")


@attrs.define
class Request:
    """One completion the fake served, for tests to read."""

    path: str
    slot: int
    prompt: list[int]
    prompt_n: int
    cache_n: int


@attrs.define
class FakeLlama:
    state_dir: Path
    n_slots: int = 2
    alias: str = "fake-model"
    modes: Modes = attrs.Factory(Modes)
    n_ctx_slot: int | None = None  # a slot's context: a prompt that leaves no room is refused, as llama-server does
    slots: list[list[int]] = attrs.field(init=False)
    requests: list[Request] = attrs.Factory(list)
    seen: list[tuple[str, str, Any]] = attrs.Factory(list)  # (path, query, body) of every request
    heard: list[tuple[str, str, str | None]] = attrs.Factory(list)  # (method, path, X-Conversation-Id)
    headed: list[tuple[str, dict[str, str]]] = attrs.Factory(list)  # (path, headers) of every request
    actions: list[tuple[str, int]] = attrs.Factory(list)  # (action, slot), in order
    # Set while a streamed reply is paused after its first token (modes.hold).
    release: trio.Event = attrs.Factory(trio.Event)
    # When set: a slot save waits for it (``saving`` counts the saves waiting).
    save_gate: trio.Event | None = None
    saving: int = 0

    def __attrs_post_init__(self) -> None:
        self.slots = [[] for _ in range(self.n_slots)]

    def client(self) -> DecoderClient:
        """A DecoderClient whose transport is this fake."""
        return DecoderClient(self.state_dir / "unused.sock", transport=HttpxWire(httpx.MockTransport(self.handle)))

    # -- the transport ------------------------------------------------------------------------------

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body: Any = json.loads(request.content) if request.content else {}
        path = request.url.path
        self.seen.append((path, request.url.query.decode(), body))
        self.heard.append((request.method, path, request.headers.get("x-conversation-id")))
        self.headed.append((path, dict(request.headers)))
        try:
            if path == "/health":
                return httpx.Response(200, json={"status": "ok"})
            if path in ("/v1/stream", "/v1/streams/lookup"):
                return self.stream_session(request.method, parse_qs(request.url.query.decode()))
            if path in OTHERS:
                return await OTHERS[path](self, body)
            if path == "/tokenize":
                return httpx.Response(200, json={"tokens": self.tokenize(body.get("content"))})
            if path == "/apply-template":
                generation_prompt = body.get("add_generation_prompt", True) is not False
                return httpx.Response(
                    200, json={"prompt": chatml(body.get("messages"), generation_prompt=generation_prompt)}
                )
            if path.startswith("/slots/"):
                if self.save_gate is not None and "action=save" in request.url.query.decode():
                    self.saving += 1
                    await self.save_gate.wait()
                    self.saving -= 1
                return self.slot_action(int(path.split("/")[2]), parse_qs(request.url.query.decode()), body)
            if path in COMPLETIONS:
                return await self.completion(path, body)
            if path in chatform.ENDPOINTS:
                return await self.agent(path, body)
        except HttpError as exc:
            return httpx.Response(exc.status, json=exc.body())
        return httpx.Response(
            404, json={"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}
        )

    def stream_session(self, method: str, query: dict[str, list[str]]) -> httpx.Response:
        """llama-server's resumable streams, as if one session, ``live``, were being written."""
        if method == "POST":
            return httpx.Response(200, json=[])
        if method == "DELETE":
            return httpx.Response(204, headers={"content-type": "application/json"})
        if query.get("conv_id") != ["live"]:
            error = {"code": 404, "message": "Stream not found or expired", "type": "not_found_error"}
            return httpx.Response(404, json={"error": error})

        async def events() -> AsyncGenerator[bytes, None]:
            yield b'data: {"n": 1}\n\n'
            await self.release.wait()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Events(events()))

    @staticmethod
    def tokenize(content: Any) -> list[int]:
        if isinstance(content, list):
            return [int(t) for t in content]
        return [token_id(word) for word in str(content).split()]

    def slot_action(self, slot: int, query: dict[str, list[str]], body: dict[str, Any]) -> httpx.Response:
        action = query.get("action", [""])[0]
        self.actions.append((action, slot))
        if action == "restore":
            path = self.state_dir / str(body.get("filename"))
            try:
                state = json.loads(path.read_bytes().removeprefix(STATE_MAGIC))
            except (OSError, ValueError):
                state = None
            if self.modes.restore_refuse or not isinstance(state, dict):
                raise HttpError(400, fake_decoder.RESTORE_FAILED)
            tokens = list(state["tokens"])
            if not self.modes.restore_unused:
                self.slots[slot] = tokens
            n_restored = len(tokens) - 1 if self.modes.restore_wrong_n else len(tokens)
            return httpx.Response(200, json={"id_slot": slot, "n_restored": n_restored})
        if action == "erase":
            n_erased, self.slots[slot] = len(self.slots[slot]), []
            return httpx.Response(200, json={"id_slot": slot, "n_erased": n_erased})
        if action == "save":
            path = self.state_dir / str(body.get("filename"))
            # llama.cpp's magic first, as the prefix store checks; a restore reads either kind of file.
            path.write_bytes(STATE_MAGIC + json.dumps({"fake_state": True, "tokens": self.slots[slot]}).encode())
            return httpx.Response(200, json={"id_slot": slot, "n_saved": len(self.slots[slot])})
        raise HttpError(400, "Invalid action")

    async def completion(self, path: str, body: dict[str, Any]) -> httpx.Response:
        if self.modes.hang:  # no answer at all (a prefill that goes on) until ``release``
            await self.release.wait()
        raw = body.get("prompt")
        if path == "/completion" and isinstance(raw, list) and all(isinstance(t, int) for t in raw):
            # Token ids, as llama-server takes them: answered as if a prompt of one word.
            job, prompt = parse_job(path, {**body, "prompt": "tokens"}), [int(t) for t in raw]
        else:
            job = parse_job(path, body)
            prompt = self.tokenize(job.prompt)
        if self.n_ctx_slot is not None and len(prompt) >= self.n_ctx_slot:
            message = (
                f"request ({len(prompt)} tokens) exceeds the available context size ({self.n_ctx_slot} tokens), "
                "try increasing it"
            )
            error = {"code": 400, "message": message, "type": "exceed_context_size_error"}
            return httpx.Response(
                400, json={"error": {**error, "n_prompt_tokens": len(prompt), "n_ctx": self.n_ctx_slot}}
            )
        cache_n = self.evaluate(path, body, prompt)
        words = [job.echo[i % len(job.echo)] for i in range(job.n_predict)]
        if self.modes.recurrent:  # its state holds the reply too, and cannot be cut back to the prompt
            self.slots[body.get("id_slot", 0)] = prompt + [token_id(word) for word in words]
        me = cast(Any, self)  # fake_decoder's reply builders read only ``alias``
        if not job.stream:
            text = " ".join(words) if job.chat else " " + " ".join(words)
            return httpx.Response(200, json=fake_decoder._final(me, job, text, cache_n, len(prompt), len(words)))

        async def events() -> AsyncGenerator[bytes, None]:
            for index, word in enumerate(words):
                yield _event(fake_decoder._token_event(me, job, word, index, len(prompt)))
                if index == 0 and self.modes.hold:
                    await self.release.wait()
            for event in fake_decoder.final_events(me, job, cache_n, len(prompt), len(words)):
                yield _event(event)
            if job.openai:
                yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Events(events()))

    def evaluate(self, path: str, body: dict[str, Any], prompt: list[int]) -> int:
        """Put ``prompt`` in the slot ``body`` asks for, reusing what the slot held; its cache_n."""
        slot = body.get("id_slot", 0)
        held = self.slots[slot]
        common = 0
        for a, b in zip(held, prompt, strict=False):
            if a != b:
                break
            common += 1
        cache_n = max(0, min(common, len(prompt) - 1)) if body.get("cache_prompt", True) else 0
        if self.modes.recurrent and (common < len(held) or common >= len(prompt)):
            cache_n = 0  # the state holds more than the common prefix: it cannot be cut back
        self.slots[slot] = prompt
        self.requests.append(Request(path, slot, prompt, len(prompt) - cache_n, cache_n))
        return cache_n

    async def agent(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """Anthropic's Messages or OpenAI's Responses: the chat form's last message's words echoed."""
        if self.modes.hang:
            await self.release.wait()
        try:
            chat = chatform.to_chat(path, body)
        except ChatFormRefused as exc:
            raise HttpError(400, str(exc)) from None
        prompt = self.tokenize(chatml(chat.get("messages")))
        cache_n = self.evaluate(path, chat, prompt)
        words = content_text(chat["messages"][-1].get("content")).split() or ["ok"]
        out = [words[i % len(words)] for i in range(int(chat.get("max_tokens") or 4))]
        if path == chatform.MESSAGES:
            return _anthropic(out, len(prompt), cache_n, stream=body.get("stream") is True)
        return _responses(out, len(prompt), cache_n, stream=body.get("stream") is True)


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


def _json(data: dict[str, Any]) -> bytes:
    """JSON as llama-server writes it into a stream: no spaces (nlohmann's ``dump()``)."""
    return json.dumps(data, separators=(",", ":")).encode()


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + _json(data) + b"\n\n"


def _not_supported(message: str) -> httpx.Response:
    return httpx.Response(
        501,
        json={"error": {"code": 501, "message": message, "type": "not_supported_error"}},
        headers={"content-type": "application/json; charset=utf-8"},
    )


async def _props(fake: FakeLlama, body: Any) -> httpx.Response:
    props: dict[str, Any] = {"total_slots": fake.n_slots, "model_alias": fake.alias, "build_info": "fake"}
    if fake.n_ctx_slot is not None:
        props["default_generation_settings"] = {"n_ctx": fake.n_ctx_slot}
    return httpx.Response(200, json=props)


async def _slots(fake: FakeLlama, body: Any) -> httpx.Response:
    return httpx.Response(200, json=[{"id": i, "is_processing": False} for i in range(fake.n_slots)])


async def _models(fake: FakeLlama, body: Any) -> httpx.Response:
    return httpx.Response(200, json={"object": "list", "data": [{"id": fake.alias, "object": "model"}]})


async def _lora(fake: FakeLlama, body: Any) -> httpx.Response:
    return httpx.Response(200, json=[])


async def _metrics(fake: FakeLlama, body: Any) -> httpx.Response:
    text = "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
    text += "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 42\n"
    return httpx.Response(200, content=text.encode(), headers={"content-type": "text/plain; version=0.0.4"})


async def _embeddings(fake: FakeLlama, body: Any) -> httpx.Response:
    return _not_supported("This server does not support embeddings. Start it with `--embeddings`")


async def _rerank(fake: FakeLlama, body: Any) -> httpx.Response:
    return _not_supported("This server does not support reranking. Start it with `--reranking`")


async def _count_tokens(fake: FakeLlama, body: Any) -> httpx.Response:
    return httpx.Response(200, json={"input_tokens": len(chatml(body.get("messages")).split())})


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: ".encode() + _json(data) + b"\n\n"


def _anthropic(out: list[str], n_prompt: int, cache_n: int, *, stream: bool) -> httpx.Response:
    """llama-server's Anthropic reply: no ``timings``; ``usage`` says what was evaluated and reused."""
    usage = {"cache_read_input_tokens": cache_n, "input_tokens": n_prompt - cache_n, "output_tokens": len(out)}
    if not stream:
        content = [{"type": "text", "text": " ".join(out)}]
        message = {"type": "message", "role": "assistant", "content": content, "usage": usage}
        return httpx.Response(200, json={"id": "msg_fake", **message, "stop_reason": "max_tokens"})

    async def events() -> AsyncGenerator[bytes, None]:
        start = {"id": "msg_fake", "type": "message", "role": "assistant", "content": []}
        yield _sse(
            "message_start", {"type": "message_start", "message": {**start, "usage": {**usage, "output_tokens": 0}}}
        )
        for word in out:
            delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": word}}
            yield _sse("content_block_delta", delta)
        stop = {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": len(out)}}
        yield _sse("message_delta", stop)
        yield _sse("message_stop", {"type": "message_stop"})

    return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Events(events()))


def _responses(out: list[str], n_prompt: int, cache_n: int, *, stream: bool) -> httpx.Response:
    """llama-server's Responses reply: ``usage`` whole, and ``timings`` on a stream's last event."""
    usage = {
        "input_tokens": n_prompt,
        "output_tokens": len(out),
        "total_tokens": n_prompt + len(out),
        "input_tokens_details": {"cached_tokens": cache_n},
    }
    text = " ".join(out)
    item = {"id": "msg_fake", "type": "message", "role": "assistant", "status": "completed"}
    output = [{**item, "content": [{"type": "output_text", "text": text, "annotations": []}]}]
    response = {"id": "resp_fake", "object": "response", "status": "completed", "output": output, "usage": usage}
    if not stream:
        return httpx.Response(200, json=response)

    async def events() -> AsyncGenerator[bytes, None]:
        yield _sse("response.created", {"type": "response.created", "response": {"id": "resp_fake"}})
        for word in out:
            yield _sse("response.output_text.delta", {"type": "response.output_text.delta", "delta": word})
        completed = {"type": "response.completed", "response": response}
        completed["timings"] = fake_decoder.timings(cache_n, n_prompt - cache_n, len(out))
        yield _sse("response.completed", completed)

    return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Events(events()))


async def _cors_proxy(fake: FakeLlama, body: Any) -> httpx.Response:
    """llama-server without --ui-mcp-proxy (server.cpp's res_403)."""
    return httpx.Response(403, json={"error": {"message": "this feature is disabled", "type": "feature_disabled"}})


Handler = Callable[[FakeLlama, Any], Awaitable[httpx.Response]]
OTHERS: dict[str, Handler] = {
    "/props": _props,
    "/slots": _slots,
    "/v1/models": _models,
    "/models": _models,
    "/lora-adapters": _lora,
    "/metrics": _metrics,
    "/embeddings": _embeddings,
    "/v1/embeddings": _embeddings,
    "/rerank": _rerank,
    "/v1/messages/count_tokens": _count_tokens,
    "/cors-proxy": _cors_proxy,
}
