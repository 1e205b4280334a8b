"""A chat request's bytes, from the front to the decoder and back, pass through each module at most twice.

The layers (docs/architecture.md) promise a path, not a web: a request goes down once (connection, the
ASGI seam, the front, the route, the decoder client, the wire) and its reply comes back up once.  This
test records that path as it is taken.  A *hand-off* is a function that moves the request's or the
reply's bytes: a socket read or write at either end, a parser feed or read, a response head or chunk
framed.  At each hand-off the test takes the whole await chain (the task and the tasks above it) and
keeps its modules in call order, consecutive frames of one module merged into one *passage*.  On each
such path a module may be passed once on the way down and once on the way back (the ASGI seam calls the
front, and the front's ``receive`` and ``send`` call back into it); a third passage on one path is a
layer calling back up into one that called it, which is what a mixed-up layering looks like.

Calls that move no bytes (a live-settings read, a metric, the store's lookup) are not hand-offs: they
are asked and answered, and docs/architecture.md says who owns each.
"""

from __future__ import annotations

import collections
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest
import trio

import supervisor
from supervisor.http import connection, wire
from supervisor.http.framing import reading, writers
from tests.rigs.helpers import CHAT, chat, client_for
from tests.rigs.rig import PROMPT, RouteRig, fake_decoder_config, ready, run_daemon

TIMEOUT = 20  # seconds; a test that needs more is stuck, not slow
ROOT = str(Path(supervisor.__file__).parent) + "/"
HANDOFFS: frozenset[CodeType] = frozenset(
    f.__code__
    for f in (
        connection.Connection.receive,
        connection.Connection.write,
        wire._Connection.send_all,
        wire._Connection.receive,
        reading._Reader.feed,
        reading._Reader.next_event,
        reading._Reader.take_body,
        writers.head,
        writers.chunk,
    )
)


def _frames(frame: FrameType) -> list[FrameType]:
    """The await chain at ``frame``, outermost first: the tasks above this one, then this one's stack."""
    ancestors = []
    task = trio.lowlevel.current_task().parent_nursery
    while task is not None:
        ancestors.append(task.parent_task)
        task = task.parent_task.parent_nursery
    frames = [f for above in reversed(ancestors) for f, _ in above.iter_await_frames()]
    own = []
    here: FrameType | None = frame
    while here is not None:
        own.append(here)
        here = here.f_back
    return frames + own[::-1]


def _passages(frames: list[FrameType]) -> tuple[str, ...]:
    modules: list[str] = []
    for f in frames:
        name = f.f_code.co_filename
        if name.startswith(ROOT) and (not modules or modules[-1] != name[len(ROOT) :]):
            modules.append(name[len(ROOT) :])
    return tuple(modules)


@contextmanager
def recorded() -> Iterator[set[tuple[str, ...]]]:
    """Every hand-off's passages while the block runs, from the request's own tasks (those under a
    client connection; the daemon's health checks and loops are not the request)."""
    paths: set[tuple[str, ...]] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in HANDOFFS:
            path = _passages(_frames(frame))
            if "http/connection.py" in path:
                paths.add(path)

    sys.setprofile(profile)
    try:
        yield paths
    finally:
        sys.setprofile(None)


def passes(path: tuple[str, ...]) -> collections.Counter[str]:
    """How many passages each module has on one path."""
    return collections.Counter(path)


def assert_at_most_twice(paths: set[tuple[str, ...]]) -> None:
    # The paths reached both ends: the client's socket, the parser, the decoder's socket, the framer.
    reached = {module for path in paths for module in path}
    assert {"http/connection.py", "http/wire.py", "http/framing/reading.py", "http/framing/writers.py"} <= reached
    over = [(path, n) for path in sorted(paths) for n in [passes(path).most_common(1)[0]] if n[1] > 2]
    assert not over, "\n".join(f"{module} {n} times: {' > '.join(path)}" for path, (module, n) in over)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_plain_chat_request_passes_each_module_at_most_twice(short_dir: Path, stream: bool) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            assert (await client.post(CHAT, json=chat("warm up"))).status_code == 200
            with recorded() as paths:
                reply = await client.post(CHAT, json=chat("hello there " * 20, stream=stream))
            assert reply.status_code == 200
    assert_at_most_twice(paths)
    # The decoder's socket was reached through the route's relay: the bytes went down and came back.
    assert any(p[-3:] == ("routes/relay.py", "llama/decoder.py", "http/wire.py") for p in paths)


async def test_a_file_route_chat_request_passes_each_module_at_most_twice(route_rig: RouteRig) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(route_rig.config("exec")) as running, client_for(running, timeout=TIMEOUT) as client:
            await ready(running, "exec")
            with recorded() as paths:
                reply = await client.post(CHAT, json=chat(PROMPT))
            assert reply.status_code == 200
            [line] = await route_rig.route_lines.until(1)
    assert line["route"] == "file"
    assert_at_most_twice(paths)


def test_a_layer_called_back_twice_on_one_path_is_refused() -> None:
    ends = ("http/connection.py", "http/wire.py", "http/framing/reading.py", "http/framing/writers.py")
    assert_at_most_twice({ends, ("a.py", "b.py", "a.py")})
    with pytest.raises(AssertionError, match=re.escape("a.py 3 times: a.py > b.py > a.py > b.py > a.py")):
        assert_at_most_twice({ends, ("a.py", "b.py", "a.py", "b.py", "a.py")})
