"""Helpers for the daemon-level tests: HTTP clients, SSE reading, held streams, waiting on conditions
(another process's among them)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import httpx
import trio

from supervisor.config import Config
from supervisor.llama.slots import SlotPool
from tests.rigs.rig import Control, DecoderModes, Running

CHAT = "/v1/chat/completions"


async def open_raw(running: Running) -> trio.SocketStream:
    """A bare connection, for what httpx will not do: send headers only, hang up mid-reply."""
    url = urlsplit(running.url)
    assert url.hostname is not None
    assert url.port is not None
    return await trio.open_tcp_stream(url.hostname, url.port)


def request_head(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


async def receive_until(stream: trio.SocketStream, buffer: bytearray, marker: bytes) -> None:
    while marker not in buffer:
        data = await stream.receive_some()
        assert data, f"connection closed before {marker!r}; got {bytes(buffer)!r}"
        buffer += data


def with_model(config: Config, **changes: Any) -> Config:
    # fake_decoder_config's ``model`` parameter is the model file, so its [model] section is set here.
    return attrs.evolve(config, model=attrs.evolve(config.model, **changes))


def assert_envelope(reply: httpx.Response, status: int, source: str = "onebitd") -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    body = reply.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "code", "source"}
    assert all(isinstance(error[key], str) and error[key] for key in ("message", "type", "code"))
    assert error["source"] == source
    assert reply.headers["x-onebit-source"] == "onebitd"
    return error


def assert_decoder_error(reply: httpx.Response, status: int) -> dict[str, Any]:
    """An error llama-server wrote, relayed as it wrote it: its shape, ``code`` the status as a number."""
    assert reply.status_code == status, reply.text
    assert reply.headers["x-onebit-source"] == "decoder"
    assert reply.headers["content-type"].startswith("application/json")
    body = reply.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert {"message", "type", "code"} <= set(error)
    assert "source" not in error
    assert error["code"] == status
    return error


def client_for(running: Running, **kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=running.url, **kwargs)


async def sse_data(response: httpx.Response) -> AsyncGenerator[str, None]:
    """The ``data:`` payloads of an event stream, as they arrive."""
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()


@asynccontextmanager
async def open_events(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> AsyncIterator[tuple[httpx.Response, AsyncGenerator[str, None]]]:
    """POST, and read the reply's events one by one; leaving the block hangs up."""
    async with client.stream("POST", path, json=body) as reply, aclosing(sse_data(reply)) as events:
        yield reply, events


def chat(text: str, *, stream: bool = False, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }


def streamed_text(events: list[str]) -> str:
    text = ""
    for data in events:
        if data != "[DONE]":
            for choice in json.loads(data)["choices"]:
                text += choice.get("delta", {}).get("content") or ""
    return text


async def wait_until(condition: Callable[[], bool]) -> None:
    """For state that no event announces (another process's doing, most often: nothing in this one
    could set a trio.Event for it); callers run under ``fail_after``."""
    while not condition():  # noqa: ASYNC110
        await trio.sleep(0.01)


def reaped(pid: int) -> bool:
    """No such process, not even a zombie: whoever started it has waited for it."""
    return not Path(f"/proc/{pid}").exists()


def gone(pid: int) -> bool:
    """The process has exited: no such pid, or a zombie its new parent has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


async def hang_up_when(running: Running, body: dict[str, Any], condition: Callable[[], bool]) -> None:
    """POST ``body`` to /completion on a bare socket and close it once ``condition`` holds.

    A bare socket, because httpx leaves unclosed async generators behind when a stream is abandoned."""
    data = json.dumps(body).encode()
    async with await open_raw(running) as raw:
        await raw.send_all(request_head("/completion", len(data)) + data)
        await wait_until(condition)


async def wait_queued(slots: SlotPool, n: int) -> None:
    await wait_until(lambda: slots.statistics().queued == n)


class HeldStream:
    """A chat stream that the fake holds after its first token, read from a task of its own: started
    (``await nursery.start(stream.run)``) once that token came, or once an error reply, which has none,
    ended."""

    def __init__(self, client: httpx.AsyncClient, text: str, max_tokens: int = 4) -> None:
        self.client = client
        self.body = chat(text, stream=True, max_tokens=max_tokens)
        self.status: int | None = None
        self.events: list[str] = []

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        started = False
        async with open_events(self.client, CHAT, self.body) as (reply, events):
            self.status = reply.status_code
            async for data in events:
                self.events.append(data)
                # The role chunk, before the first token, does not count.
                if not started and (data == "[DONE]" or json.loads(data)["choices"][0]["delta"].get("content")):
                    started = True
                    task_status.started()
        if not started:
            task_status.started()


@asynccontextmanager
async def open_held_streams(
    control: Control, client: httpx.AsyncClient, *texts: str
) -> AsyncIterator[list[HeldStream]]:
    """A chat stream per text, each held by the fake decoder after its first token (``hold``) and read
    by a task of its own; the block starts once every one has its first token.  Leaving it lets them
    finish (a test may let them go sooner: ``control.set(decoder=DecoderModes())``) and waits for them."""
    control.set(decoder=DecoderModes(hold=True))
    streams = [HeldStream(client, text) for text in texts]
    async with trio.open_nursery() as nursery:
        for stream in streams:
            await nursery.start(stream.run)
        yield streams
        control.set(decoder=DecoderModes())
