"""The admin API: a WebSocket on a unix socket in the runtime directory (mode 0660, never TCP).

One connection per command.  The client sends one JSON object ``{"verb": NAME, "args": {...}}``;
the daemon answers with zero or more event objects (``{"event": ...}``) and ends with exactly one
``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "..."}``, then closes.  ``watch`` never
ends on its own: the client closes it.

Verbs are the ``VERBS`` table below, the one place they are declared: a name, the arguments it
takes (``args`` keys; ``--NAME`` options of ``onebitctl``), and a handler whose docstring gives its
wire format.  ``onebitctl`` derives its daemon subcommands from it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import trio
from trio_websocket import (
    ConnectionClosed,
    HandshakeError,
    WebSocketConnection,
    wrap_client_stream,
    wrap_server_stream,
)

from ..config import converter
from ..errors import AdminError, AdminUnavailable, ClientError, ConfigError, DecoderError
from ..observe.routestats import RouteStats
from ..observe.status import DaemonStatistics, ModelStatistics, to_wire
from ..prefix.statistics import OFF
from ..prefix.store import PrefixStore
from ..supervise.child import RECENT_LINES, Child

log = logging.getLogger("onebit.admin")


class Managed(Protocol):
    """What the verbs need of the daemon."""

    route_stats: RouteStats

    def statistics(self) -> DaemonStatistics: ...

    def inflight_count(self) -> int: ...

    def start_drain(self) -> None: ...

    async def keep_slots(self) -> int: ...

    def resume(self) -> None: ...

    async def wait_inflight_changed(self) -> None: ...

    def reload(self) -> dict[str, Any]: ...

    def store_of(self, name: str | None = None) -> PrefixStore | None: ...  # None: it has none

    async def load(self, name: str) -> ModelStatistics: ...

    async def unload(self, name: str) -> ModelStatistics: ...

    def children(self) -> Sequence[Child]: ...  # every supervised child, as ``status`` lists them


# How long a client waits for the daemon's side of the websocket close handshake once it has its
# answer: a local daemon replies in milliseconds; nothing is lost when it does not.
CLOSE_TIMEOUT_S = 1.0

Send = Callable[[dict[str, Any]], Awaitable[None]]
Handler = Callable[[Managed, dict[str, Any], Send], Awaitable[Any]]


async def verb_status(daemon: Managed, args: dict[str, Any], send: Send) -> Any:
    """``{"verb": "status"}`` -> ``{"ok": true, "result": <statistics>}``: daemon state, uptime,
    children, providers, slots, queue, in-flight requests, counts per route and fallback, first-byte
    median and p95 over the last requests.  Answers in every daemon state."""
    return to_wire(daemon.statistics())


async def verb_drain(daemon: Managed, args: dict[str, Any], send: Send) -> Any:
    """``{"verb": "drain", "args": {"timeout": S}}``: new requests get 503, in-flight ones finish.
    Events ``{"event": "progress", "inflight": N}`` on every change; once none is in flight, every
    slot holding a long prompt is saved into the prefix store (the hand-over); the result is
    ``{"drained": true, "kept": N}`` (N slots saved), or
    ``{"ok": false, "error": "...", "remaining": [...]}`` at the timeout."""
    timeout = args.get("timeout")
    if timeout is not None and (not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout < 0):
        raise AdminError("drain: timeout must be a number of seconds >= 0")
    daemon.start_drain()
    with trio.move_on_after(float("inf") if timeout is None else float(timeout)):
        count = daemon.inflight_count()
        while True:
            await send({"event": "progress", "inflight": count})
            if count == 0:
                return {"drained": True, "kept": await daemon.keep_slots()}
            # Checked again right before waiting: a request that ended while the event above was
            # being sent set the previous event, which nobody waits on any more.
            while daemon.inflight_count() == count:
                await daemon.wait_inflight_changed()
            count = daemon.inflight_count()
    remaining = to_wire(daemon.statistics())["inflight"]
    raise AdminError(f"drain timed out with {len(remaining)} in flight", remaining=remaining)


async def verb_resume(daemon: Managed, args: dict[str, Any], send: Send) -> Any:
    """``{"verb": "resume"}`` -> ``{"ok": true, "result": {"draining": false}}``: undo a drain."""
    daemon.resume()
    return {"draining": False}


async def verb_watch(daemon: Managed, args: dict[str, Any], send: Send) -> Any:
    """``{"verb": "watch"}``: ``{"event": "line", "at": T, "line": {<route line fields>}}`` per request, as
    each one ends, and ``{"event": "model", "model", "from", "to", "why"}`` and ``{"event": "child",
    "model", "child", "from", "to", "why"}`` per transition of a model and of its decoder, until the
    client closes (the status page's ``/onebit/events`` is the same feed)."""
    async with daemon.route_stats.watch() as feed:
        await send({"event": "watching"})
        async for event in feed:
            await send(event)
    return None


async def verb_reload(daemon: Managed, args: dict[str, Any], send: Send) -> Any:
    """``{"verb": "reload"}``: re-read the config file.  Result ``{"applied": [keys], "restart_needed":
    [keys]}``; a config with errors is refused (``ok: false`` with the error lines) and the running
    one stays."""
    try:
        return daemon.reload()
    except ConfigError as exc:
        raise AdminError("the new config has errors; the running one stays", lines=exc.lines) from None


def _model_name(verb: str, args: dict[str, Any]) -> str:
    name = args.get("model")
    if not isinstance(name, str) or not name:
        raise AdminError(f"{verb}: model must be the name of a model")
    return name


async def verb_load(daemon: Managed, args: dict[str, Any], send: Send) -> Any:
    """``{"verb": "load", "args": {"model": NAME}}`` -> ``{"ok": true, "result": <the model's
    statistics>}``: load the model now (unloading the least recently used idle ones in its way) and
    answer once it is loaded or failed, or after models.load_timeout_s (its state says which)."""
    try:
        return converter.unstructure(await daemon.load(_model_name("load", args)))
    except ClientError as exc:
        raise AdminError(exc.message) from None
    except DecoderError as exc:
        raise AdminError(exc.public) from None


async def verb_unload(daemon: Managed, args: dict[str, Any], send: Send) -> Any:
    """``{"verb": "unload", "args": {"model": NAME}}`` -> ``{"ok": true, "result": <the model's
    statistics>}``: unload the model once the requests that hold it are done (its slots' prompts are
    kept in the prefix store first); answers once it is unloaded.  A request for it loads it again."""
    try:
        return converter.unstructure(await daemon.unload(_model_name("unload", args)))
    except ClientError as exc:
        raise AdminError(exc.message) from None


async def verb_logs(daemon: Managed, args: dict[str, Any], send: Send) -> Any:
    """``{"verb": "logs", "args": {"child": NAME, "lines": N}}`` (``lines`` optional) -> ``{"ok": true,
    "result": {"child": NAME, "lines": [{"at": T, "life": N, "line": "..."}, ...]}}``: the child's
    last N lines of output (without ``lines``, all it keeps: supervisor/supervise/child.py's
    ``RECENT_LINES``), oldest first, whatever level onebitd logged them at; ``at`` is when onebitd
    read the line, ``life`` which start of the child wrote it (its restarts then).  NAME is one of
    the children ``status`` lists (``decoder``, ``provider-NAME``)."""
    name = args.get("child")
    if not isinstance(name, str) or not name:
        raise AdminError("logs: child must be the name of a child")
    count = args.get("lines", RECENT_LINES)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise AdminError("logs: lines must be a number of lines >= 1")
    children = {child.name: child for child in daemon.children()}
    if name not in children:
        raise AdminError(f"logs: no child named {name!r}; children here: {', '.join(children)}")
    heard = children[name].recent()[-count:]
    return {"child": name, "lines": [{"at": h.at, "life": h.life, "line": h.line} for h in heard]}


def seconds(text: str) -> float:
    """A number of seconds >= 0, from a command line."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def lines(text: str) -> int:
    """A number of lines >= 1, from a command line."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"expected a number of lines >= 1, got {text!r}")
    return value


@attrs.frozen
class Argument:
    """An argument a verb takes: ``args[name]`` on the wire, ``--name`` on onebitctl's command line.
    Left out when not given."""

    name: str
    type: Callable[[str], Any]  # the command line's text to the value sent; ValueError names what it expected
    metavar: str
    help: str
    positional: bool = False  # ``onebitctl VERB VALUE``, required, rather than ``--name VALUE``


@attrs.frozen
class Verb:
    handler: Handler  # its docstring: the verb's wire format
    arguments: tuple[Argument, ...] = ()


async def verb_cache_list(daemon: Managed, args: dict[str, Any], send: Send) -> Any:
    """``{"verb": "cache list", "args": {"model": NAME}}`` (``model`` optional) -> ``{"ok": true,
    "result": {"statistics": {...}, "entries": [{"key", "n_tokens", "state_bytes", "disk_bytes",
    "created", "last_used"}, ...]}}``: the prefix store's entries (the model's, else the default
    model's), most recently used first (tokens left out)."""
    store = _store(daemon, args)
    entries = [
        {
            "key": entry.key,
            "n_tokens": entry.n_tokens,
            "state_bytes": entry.state_bytes,
            "disk_bytes": entry.disk_bytes,
            "created": entry.created,
            "last_used": entry.last_used,
        }
        for entry in (store.list() if store is not None else [])
    ]
    statistics = store.statistics() if store is not None else OFF
    return {"statistics": converter.unstructure(statistics), "entries": entries}


async def verb_cache_clear(daemon: Managed, args: dict[str, Any], send: Send) -> Any:
    """``{"verb": "cache clear", "args": {"model": NAME}}`` (``model`` optional) -> ``{"ok": true,
    "result": {"removed": N}}``: every entry not in use is removed from the prefix store (the
    model's, else the default model's; an entry being restored goes when its restore ends)."""
    store = _store(daemon, args)
    return {"removed": await store.clear() if store is not None else 0}


def _store(daemon: Managed, args: dict[str, Any]) -> PrefixStore | None:
    """The prefix store of ``args["model"]`` (each model has its own), else the default model's;
    None where it has none."""
    name = args.get("model")
    if name is not None and not isinstance(name, str):
        raise AdminError("model must be the name of a model")
    try:
        return daemon.store_of(name)
    except ClientError as exc:
        raise AdminError(exc.message) from None


# The cache verbs' argument: each model has a prefix store of its own.
_STORE_OF = Argument("model", str, "MODEL", "that model's prefix store (default: the default model's)")

VERBS: dict[str, Verb] = {
    "status": Verb(verb_status),
    "drain": Verb(verb_drain, (Argument("timeout", seconds, "S", "give up after S seconds (default: wait)"),)),
    "resume": Verb(verb_resume),
    "watch": Verb(verb_watch),
    "reload": Verb(verb_reload),
    "cache list": Verb(verb_cache_list, (_STORE_OF,)),
    "cache clear": Verb(verb_cache_clear, (_STORE_OF,)),
    "load": Verb(verb_load, (Argument("model", str, "MODEL", "the model's name or alias", positional=True),)),
    "unload": Verb(verb_unload, (Argument("model", str, "MODEL", "the model's name or alias", positional=True),)),
    "logs": Verb(
        verb_logs,
        (
            Argument("child", str, "CHILD", "a child as status lists it: decoder, provider-NAME", positional=True),
            Argument("lines", lines, "N", "only its last N lines (default: all it keeps)"),
        ),
    ),
}


class AdminServer:
    def __init__(self, daemon: Managed, path: Path) -> None:
        self.daemon = daemon
        self.path = path

    async def run(self, *, task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED) -> None:
        self.path.unlink(missing_ok=True)
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(str(self.path))
        # Group-writable so an operators' group can be given onebitctl; never world-accessible.
        os.chmod(self.path, 0o660)
        sock.listen(16)
        try:
            async with trio.open_nursery() as nursery:
                # trio-websocket's WebSocketServer assumes an IP listener; a unix one is served by hand.
                await nursery.start(trio.serve_listeners, self._handle, [trio.SocketListener(sock)])
                task_status.started(self.path)
        finally:
            self.path.unlink(missing_ok=True)

    async def _handle(self, stream: trio.SocketStream) -> None:
        with contextlib.suppress(ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            async with trio.open_nursery() as nursery:
                request = await wrap_server_stream(nursery, stream)
                ws = await request.accept()
                await self._serve(ws)

    async def _serve(self, ws: WebSocketConnection) -> None:
        async def send(data: dict[str, Any]) -> None:
            await ws.send_message(json.dumps(data))

        try:
            raw = await ws.get_message()
            request = json.loads(raw)
            if not isinstance(request, dict) or not isinstance(request.get("verb"), str):
                raise AdminError('expected {"verb": NAME, "args": {...}}')
            verb = VERBS.get(request["verb"])
            if verb is None:
                raise AdminError(f"unknown verb {request['verb']!r}; known: {', '.join(VERBS)}")
            args = request.get("args") or {}
            if not isinstance(args, dict):
                raise AdminError("args must be an object")
            outcome: list[Any] = []

            async def run_verb() -> None:
                try:
                    outcome.append({"ok": True, "result": await verb.handler(self.daemon, args, send)})
                except AdminError as exc:
                    outcome.append({"ok": False, "error": exc.message, **exc.extra})

            async with trio.open_nursery() as nursery:
                # A client that goes away ends its verb (watch, drain) instead of leaking it.
                nursery.start_soon(_cancel_on_close, ws, nursery.cancel_scope)
                await run_verb()
                nursery.cancel_scope.cancel()
            if not outcome:
                return  # the client left: nobody to answer
            await send(outcome[0])
        except AdminError as exc:
            await send({"ok": False, "error": exc.message, **exc.extra})
        except ValueError:
            await send({"ok": False, "error": "the request is not JSON"})
        await ws.aclose()


async def _cancel_on_close(ws: WebSocketConnection, scope: trio.CancelScope) -> None:
    try:
        while True:
            await ws.get_message()
    except ConnectionClosed:
        scope.cancel()


async def call(
    path: Path, verb: str, args: dict[str, Any] | None = None, on_event: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """The client side: run one verb, pass events to ``on_event``, return the final object."""
    try:
        stream = await trio.open_unix_socket(str(path))
    except OSError as exc:
        raise AdminUnavailable(f"cannot connect to {path}: {exc.strerror or exc} (is onebitd running?)") from None
    result: dict[str, Any] = {}
    try:
        async with trio.open_nursery() as nursery:
            ws = await wrap_client_stream(nursery, stream, "localhost", "/")
            await ws.send_message(json.dumps({"verb": verb, "args": args or {}}))
            while not result:
                message = json.loads(await ws.get_message())
                if "ok" in message:
                    result = message
                elif on_event is not None:
                    on_event(message)
            # The answer is in: the close handshake waits for the daemon's reply, which a busy or
            # dying daemon may never send, so it is given a bound and the stream closed regardless.
            with trio.move_on_after(CLOSE_TIMEOUT_S):
                await ws.aclose()
            nursery.cancel_scope.cancel()
    except* HandshakeError as group:
        raise AdminUnavailable(f"{path} is not an onebitd admin socket ({group.exceptions[0]!r})") from None
    except* (ConnectionClosed, ValueError) as group:
        raise AdminUnavailable(f"{path}: the daemon closed the connection ({group.exceptions[0]!r})") from None
    finally:
        await stream.aclose()
    return result
