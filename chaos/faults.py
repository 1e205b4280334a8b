"""The faults the chaos scenarios inject, and the waits around them: a process stopped (SIGSTOP,
undone in a ``finally``), the decoder killed during a restore, a provider found mid-job, and raw
requests on a bare socket (hang-ups, slow readers, malformed HTTP).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from chaos.rig import Onebitd, children_of, same_process, start_time
from chaos.traffic import COMPLETIONS
from supervisor.providers.exec import ExecProvider
from supervisor.supervise.child import ChildState


@asynccontextmanager
async def stopped(pid: int) -> AsyncIterator[None]:
    """SIGSTOP ``pid`` (a child our onebitd started) for the block; SIGCONT after, if it still lives."""
    start = start_time(pid)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if same_process(pid, start):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


class RestoreKiller:
    """Stands between the file route and the decoder: kills the decoder as a restore is asked."""

    def __init__(self, inner: Any, od: Onebitd) -> None:
        self.inner = inner
        self.od = od
        self.armed = True

    async def post_json(self, path: str, body: Any) -> tuple[int, Any]:
        if self.armed and "action=restore" in path:
            self.armed = False
            pid = self.od.daemon.models.default.decoder.pid
            assert pid is not None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._kill_soon, pid)
                result: tuple[int, Any] = await self.inner.post_json(path, body)
            return result
        answer: tuple[int, Any] = await self.inner.post_json(path, body)
        return answer

    @staticmethod
    async def _kill_soon(pid: int) -> None:
        await trio.sleep(0.005)  # the restore request is on its way
        os.kill(pid, signal.SIGKILL)


def provider_pid(od: Onebitd) -> int | None:
    provider = od.daemon.models.default.parts.providers.all[0]
    if isinstance(provider, ExecProvider):
        # The job's program: onebitd's child running llama_exec_provider.py.
        jobs = [pid for pid, cmd in children_of(os.getpid()).items() if "llama_exec_provider.py" in cmd]
        return jobs[0] if jobs else None
    child = provider.child
    return None if child is None else child.pid


async def wait_provider_job(od: Onebitd) -> int:
    provider = od.daemon.models.default.parts.providers.all[0]
    while True:  # the provider's process: another process's state, polled
        pid = provider_pid(od)
        if provider.busy and pid is not None:
            return pid
        await trio.sleep(0.02)


async def provider_ready(od: Onebitd, generation: int) -> None:
    child = od.daemon.models.default.parts.providers.all[0].child
    if child is None:
        return
    while not (child.generation > generation and child.state is ChildState.READY):  # noqa: ASYNC110
        await trio.sleep(0.05)  # its Child's transitions; generation is not an event


async def nursery_done(result: list[Any]) -> None:
    while not result:  # noqa: ASYNC110  # set by the request's own task in the same nursery
        await trio.sleep(0.02)


def raw_request(path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    )
    return head.encode() + b"Connection: close\r\n\r\n" + data


async def open_raw(od: Onebitd, rcvbuf: int | None = None) -> trio.SocketStream:
    host, port = od.url.removeprefix("http://").rsplit(":", 1)
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect((host.strip("[]"), int(port)))
    return trio.SocketStream(sock)


async def hang_up_after(od: Onebitd, body: dict[str, Any], delay: float) -> None:
    async with await open_raw(od) as raw:
        await raw.send_all(raw_request(COMPLETIONS, body))
        await trio.sleep(delay)


async def send_case(od: Onebitd, raw: bytes) -> tuple[int | None, bool]:
    """``(status or None, closed)``: what the front answered, and whether it closed in time."""
    from chaos.fuzz import CASE_BOUND_S

    received = b""
    with trio.move_on_after(CASE_BOUND_S):
        async with await open_raw(od) as stream:
            try:
                await stream.send_all(raw)
                while chunk := await stream.receive_some(65536):
                    received += chunk
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        status = int(received.split(b" ", 2)[1]) if received.startswith(b"HTTP/1.1 ") else None
        return status, True
    return None, False
