"""supervisor/connection.py's pieces inside hypercorn, driven in process: a response that declares
its length goes out in one send, head and body, any other head at once; a keep-alive connection is
closed after its idle timeout, or at once when the server stops, and never while a request is on it."""

from __future__ import annotations

from typing import Any, cast

import attrs
import hypercorn.trio.run
import pytest
import trio
import trio.testing
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.events import Event, RawData
from hypercorn.protocol import ProtocolWrapper
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState

from supervisor import connection
from supervisor.connection import IdleDeadline, Protocol

TIMEOUT = 10
GET = b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"
HEAD = b"HEAD / HTTP/1.1\r\nHost: localhost\r\n\r\n"


async def served(app: Any, request: bytes, *, until: trio.Event | None = None) -> list[Event]:
    """What the protocol hands its connection for ``request``: the bytes to send and the rest.
    With ``until``: the events before it is set, a ``RawData(b"|")``, and those after."""
    sent: list[Event] = []

    async def send(event: Event) -> None:
        sent.append(event)

    with trio.fail_after(TIMEOUT):
        async with TaskGroup() as task_group:
            protocol = Protocol(
                ASGIWrapper(app),
                Config(),
                WorkerContext(None),
                task_group,
                ConnectionState({}),
                False,
                None,
                None,
                send,
            )
            await protocol.initiate()
            await protocol.handle(RawData(request))
            await trio.testing.wait_all_tasks_blocked()
            if until is not None:
                sent.append(RawData(b"|"))
                until.set()
                await trio.testing.wait_all_tasks_blocked()
    return sent


async def writes(app: Any, request: bytes, *, until: trio.Event | None = None) -> list[bytes]:
    """What the protocol hands its connection to send for ``request``, one entry per send."""
    return [
        event.data for event in await served(app, request, until=until) if isinstance(event, RawData) and event.data
    ]


def whole(body: bytes) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return app


async def test_a_response_that_declares_its_length_is_one_send() -> None:
    [data] = await writes(whole(b"hello"), GET)
    assert data.startswith(b"HTTP/1.1 200 ")
    assert data.endswith(b"\r\n\r\nhello")


@pytest.mark.parametrize(("request_", "body"), [(HEAD, b"hello"), (GET, b"")], ids=["head", "empty"])
async def test_a_response_with_no_body_to_send_still_sends_its_head(request_: bytes, body: bytes) -> None:
    [data] = await writes(whole(body), request_)
    assert data.startswith(b"HTTP/1.1 200 ")
    assert data.endswith(b"\r\n\r\n")


async def test_a_streamed_head_goes_out_before_its_body() -> None:
    go_on = trio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await go_on.wait()
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": False})

    head, mark, *rest = await writes(app, GET, until=go_on)
    assert head.startswith(b"HTTP/1.1 200 ")
    assert head.endswith(b"\r\n\r\n")
    assert mark == b"|"
    assert b"".join(rest) == b"9\r\ndata: 1\n\n\r\n0\r\n\r\n"


async def test_an_app_that_fails_after_a_declared_head_still_sends_it() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-length", b"5")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        raise RuntimeError("the app failed before its body")

    sent = await writes(app, GET)
    assert sent[0].startswith(b"HTTP/1.1 200 ")
    assert sent[0].endswith(b"\r\n\r\n")


# -- the idle timer -----------------------------------------------------------------------------------


@attrs.define
class Idling:
    """What IdleDeadline sees of a connection: hypercorn's config and worker context, and its close."""

    config: Config
    context: WorkerContext = attrs.Factory(lambda: WorkerContext(None))
    closed_at: list[float] = attrs.Factory(list)

    async def _initiate_server_close(self) -> None:
        self.closed_at.append(trio.current_time())


def hypercorn_action() -> None:
    """Stands for hypercorn's ``_idle_timeout``, which IdleDeadline does itself."""


async def idle_timer(nursery: trio.Nursery, keep_alive_timeout: float) -> tuple[Idling, IdleDeadline, Any]:
    config = Config()
    config.keep_alive_timeout = keep_alive_timeout
    idling = Idling(config)
    group = attrs.make_class("Group", {"_nursery": attrs.field()})(nursery)
    return idling, IdleDeadline(cast(Any, idling)), group


async def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(autojump_clock: trio.abc.Clock) -> None:
    async with trio.open_nursery() as nursery:
        idling, timer, group = await idle_timer(nursery, 5.0)
        start = trio.current_time()
        await timer.restart(group, hypercorn_action)  # connected: idle until the first request
        await trio.sleep(3)
        await timer.stop()  # a request
        await trio.sleep(60)  # however long it takes
        assert idling.closed_at == []
        await timer.restart(group, hypercorn_action)  # its response is out
        await trio.sleep(60)
    assert idling.closed_at == [start + 63 + 5]


async def test_a_stop_closes_an_idle_connection_at_once_and_a_busy_one_once_its_response_is_out(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with trio.open_nursery() as nursery:
        idle, idle_timer_, group = await idle_timer(nursery, 75.0)
        busy, busy_timer, _ = await idle_timer(nursery, 75.0)
        busy.context = idle.context
        start = trio.current_time()
        await idle_timer_.restart(group, hypercorn_action)
        await busy_timer.restart(group, hypercorn_action)
        await busy_timer.stop()
        await trio.sleep(1)
        await idle.context.terminated.set()  # hypercorn's shutdown
        await trio.sleep(10)
        assert (idle.closed_at, busy.closed_at) == ([start + 1], [])
        await busy_timer.restart(group, hypercorn_action)
        await trio.testing.wait_all_tasks_blocked()
    assert busy.closed_at == [start + 11]


def test_hypercorn_builds_its_connections_and_protocols_from_where_install_puts_ours() -> None:
    # install() replaces names in hypercorn's modules; a hypercorn that looked elsewhere would
    # silently serve with its own classes again.
    connection.install()
    assert ProtocolWrapper.__init__.__globals__["H11Protocol"] is Protocol
    assert hypercorn.trio.run.worker_serve.__globals__["TCPServer"] is connection.Connection


async def test_a_connection_whose_reading_ended_ends_its_timer_without_closing_again(
    autojump_clock: trio.abc.Clock,
) -> None:
    # hypercorn waits for a connection's tasks before it closes its socket: a timer left waiting
    # (here, a request was on the connection when the client went) would keep that socket open.
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            idling, timer, group = await idle_timer(nursery, 5.0)
            await timer.restart(group, hypercorn_action)
            await timer.stop()
            await trio.sleep(1)
            timer.finish()
    assert idling.closed_at == []
