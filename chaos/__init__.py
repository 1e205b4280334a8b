"""onebit's chaos suite: faults on the real parts, and proof that nothing is lost (docs/reliability.md).

    scripts/chaos [--quick] [--only NAME ...] [--time-limit S]    scripts/chaos --list

Every scenario runs onebitd in this process (port 0, a runtime directory under /tmp) with the real
llama-server as its decoder, and where it needs one a real provider (a llama-server provider, or
tests/llama_exec_provider.py / tests/llama_worker_provider.py for the exec and worker kinds); it sends
a bounded number of requests, injects its fault, and prints one line:

    requests sent, answered correctly, answered with a clean error, lost, left behind

* correct: a 200 whose reply is whole (a streamed one ends with ``[DONE]``) with the tokens asked for;
* a clean error: an HTTP error in onebitd's or llama-server's JSON envelope (a 503 with Retry-After),
  or a stream that ends with an SSE ``error`` event;
* lost: no answer within the scenario's bound, or a connection that hangs;
* left behind: processes under onebitd beyond its decoder and providers, files in ``<runtime>/state``,
  stray sockets in the runtime directory, onebitd's open fds beyond the tolerance, and (after the
  daemon stopped) any process it started that is not reaped.

A lost request, a leftover, or a reply that is neither right nor a clean error fails the scenario,
and so does a scenario that sent no request at all.  One that cannot run on this machine
(``disk-full`` without the permission to mount) says ``skip`` and why, never ``ok``.  Exit status 1
when any scenario failed (a skip is no failure), 2 for a set-up problem.  Signals go only to the
pids of the decoder and providers this process's onebitd started, and every SIGSTOP is undone in a
``finally``.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import json
import logging
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from supervisor import config as configuration
from supervisor.config import Config, locate
from supervisor.daemon import Daemon
from supervisor.llama.llama_server import connection_limit, model_args
from supervisor.observe.logs import ROUTE_LOGGER
from supervisor.providers.exec import ExecProvider
from supervisor.supervise.child import ChildState
from supervisor.testing import Clients, Running, run_daemon

ROOT = Path(__file__).resolve().parent.parent

TESTS = ROOT / "tests"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# The health policy every chaos decoder runs with: a hung decoder is noticed after `failures` checks
# of up to `timeout_s` each, `interval_s` apart, and killed `stop_grace_s` after SIGTERM.
HEALTH = {"interval_s": 0.5, "timeout_s": 2.0, "failures": 2, "stop_grace_s": 1.0, "start_timeout_s": 300.0}
RESTART = {"backoff_initial_s": 0.2, "backoff_max_s": 2.0, "max_failures": 50, "window_s": 60.0}
# What a hang costs at most, from the SIGSTOP to the stream's error event (docs/reliability.md).
HANG_BOUND_S = HEALTH["failures"] * (HEALTH["interval_s"] + HEALTH["timeout_s"]) + HEALTH["stop_grace_s"]
# Slack on a shared, loaded 2-core machine: an event loop that is late, a kill that is reaped late.
SLACK_S = 10.0
# A provider job that takes longer goes plain (hybrid.prefill_timeout_s in the chaos config).
PREFILL_TIMEOUT_S = 8.0
# A SIGSTOPped supervised provider is killed within HANG_BOUND_S; its restart loads the model again,
# a few seconds here, allowed this much on a loaded machine.
PROVIDER_START_S = 60.0
# onebitd keeps keep-alive connections to each llama-server (connection_limit) and the admin socket:
# fds beyond the baseline up to this many are pooled connections, not leaks.
FD_TOLERANCE = 2 * connection_limit(4)
# RSS growth over a soak, and during the slow readers, that still counts as bounded.
RSS_TOLERANCE_MIB = 48.0
# One request on this model never takes this long; past it, it is lost, not slow.
REQUEST_BOUND_S = 240.0
# Prompts: a short one stays plain (under min_prompt_tokens), a long one goes hybrid.
SHORT = "Say hello."
LONG = (
    "The moon is Earth's only natural satellite. It orbits at an average distance of 384,400 km and "
    "always shows the same face. Write one short sentence about its phases:"
)


def fresh(prompt: str, tag: object) -> str:
    """``prompt`` made new from its first token: no slot holds a prefix of it, so the route is not
    chosen for what a slot already holds (reason ``cached``)."""
    return f"{tag}: {prompt}"


class ChaosError(Exception):
    """A set-up problem: the figures would mean nothing."""


class Skipped(Exception):
    """A scenario that cannot run on this machine; the message says why.  Reported as ``skip``."""


# -- what came back --------------------------------------------------------------------------------


@attrs.define
class Tally:
    sent: int = 0
    ok: int = 0
    clean: int = 0
    lost: int = 0
    bad: int = 0
    hung_up: int = 0  # clients that left on purpose: no answer expected
    notes: list[str] = attrs.Factory(list)
    leftovers: list[str] = attrs.Factory(list)
    figures: dict[str, Any] = attrs.Factory(dict)
    skipped: str = ""  # why the scenario could not run here

    def add(self, verdict: str, note: str = "") -> None:
        self.sent += 1
        if verdict == "ok":
            self.ok += 1
        elif verdict == "clean":
            self.clean += 1
        elif verdict == "lost":
            self.lost += 1
        elif verdict == "hung_up":
            self.hung_up += 1
        else:
            self.bad += 1
        if verdict in ("lost", "bad") and note:
            self.notes.append(f"{verdict}: {note}")

    def check(self, condition: bool, what: str) -> None:
        if not condition:
            self.notes.append(f"failed: {what}")

    @property
    def failed(self) -> bool:
        return bool(self.lost or self.bad or self.leftovers or any(n.startswith("failed") for n in self.notes))


def is_envelope(body: bytes) -> bool:
    try:
        data = json.loads(body)
    except ValueError:
        return False
    error = data.get("error") if isinstance(data, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str)


def judge_whole(status: int, headers: httpx.Headers, body: bytes, tokens: int | None) -> tuple[str, str]:
    if status == 200:
        try:
            data = json.loads(body)
        except ValueError:
            return "bad", "200 with a body that is not JSON"
        got = (data.get("usage") or {}).get("completion_tokens")
        if tokens is not None and got != tokens:
            return "bad", f"200 with {got} tokens, asked for {tokens}"
        return "ok", ""
    if status >= 400 and is_envelope(body):
        if status == 503 and "retry-after" not in headers:
            return "bad", "503 without Retry-After"
        return "clean", ""
    return "bad", f"{status}: {body[:200]!r}"


def judge_events(events: list[str], tokens: int | None) -> tuple[str, str]:
    """A stream's ``data:`` payloads: whole (``[DONE]``, finish_reason), or ended by an error event."""
    if events and events[-1] != "[DONE]":
        try:
            last = json.loads(events[-1])
        except ValueError:
            return "bad", f"a stream ending with {events[-1][:100]!r}"
        if isinstance(last, dict) and "error" in last:
            return "clean", ""
        return "bad", "a stream cut short without an error event"
    if not events:
        return "bad", "an empty stream"
    pieces = 0
    finished = False
    for data in events[:-1]:
        payload = json.loads(data)
        if "error" in payload:
            return "bad", "an error event before [DONE]"
        for choice in payload.get("choices") or []:
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                pieces += 1
            finished = finished or choice.get("finish_reason") is not None
    if not finished or (tokens is not None and pieces == 0):
        return "bad", "a stream without its end"
    return "ok", ""


def body_for(prompt: str, *, stream: bool, tokens: int, chat: bool = False, **extra: Any) -> dict[str, Any]:
    # ignore_eos: the reply has exactly `tokens` tokens, which is how a whole reply is judged correct.
    common = {"max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": stream, **extra}
    if chat:
        return {"messages": [{"role": "user", "content": prompt}], **common}
    return {"prompt": prompt, **common}


async def ask(
    client: httpx.AsyncClient, body: dict[str, Any], *, chat: bool = False, bound: float = REQUEST_BOUND_S
) -> tuple[str, str, int]:
    """Send one request; ``(verdict, note, status)``."""
    path = CHAT if chat else COMPLETIONS
    tokens = body.get("max_tokens")
    status = 0
    with trio.move_on_after(bound):
        try:
            if not body.get("stream"):
                reply = await client.post(path, json=body)
                verdict, note = judge_whole(reply.status_code, reply.headers, reply.content, tokens)
                return verdict, note, reply.status_code
            async with client.stream("POST", path, json=body) as reply:
                status = reply.status_code
                if status != 200:
                    content = await reply.aread()
                    verdict, note = judge_whole(status, reply.headers, content, tokens)
                    return verdict, note, status
                events = [line[5:].strip() async for line in reply.aiter_lines() if line.startswith("data:")]
            verdict, note = judge_events(events, tokens)
            return verdict, note, status
        except httpx.HTTPError as exc:
            return "bad", f"{type(exc).__name__}: {exc}", status
    return "lost", f"no answer within {bound:g}s", status


async def ask_until_ok(
    client: httpx.AsyncClient, tally: Tally, body: dict[str, Any], *, bound: float, chat: bool = False
) -> float:
    """Ask until a correct answer, honouring Retry-After; every try is counted.  The seconds taken."""
    started = trio.current_time()
    with trio.move_on_after(bound):
        while True:
            verdict, note, _ = await ask(client, body, chat=chat, bound=bound)
            tally.add(verdict, note)
            if verdict in ("ok", "lost", "bad"):
                return trio.current_time() - started
            await trio.sleep(1.0)  # Retry-After: 1 (server.retry_after_s)
    tally.add("lost", f"no correct answer within {bound:g}s of retries")
    return trio.current_time() - started


# -- what was left behind --------------------------------------------------------------------------


def children_of(pid: int) -> dict[int, str]:
    """Every descendant of ``pid``: pid -> command line."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                try:
                    found[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
                except OSError:
                    found[child] = "?"
                frontier.append(child)
    return found


def gone(pid: int) -> bool:
    """The process has exited: no such pid, or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def same_process(pid: int, start: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19] == start
    except (OSError, IndexError):
        return False


def start_time(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


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


# -- onebitd under test ----------------------------------------------------------------------------


@attrs.frozen
class Onebitd:
    """onebitd as chaos sees it: running in this trio run (supervisor/testing.py), its two clients,
    the route lines it logged, and what it left behind."""

    running: Running
    clients: Clients
    lines: list[dict[str, Any]]

    @property
    def daemon(self) -> Daemon:
        return self.running.daemon

    @property
    def url(self) -> str:
        return self.running.url

    @property
    def front(self) -> httpx.AsyncClient:
        return self.clients.front

    @property
    def direct(self) -> httpx.AsyncClient:  # straight to the decoder's socket
        return self.clients.direct

    @property
    def runtime(self) -> Path:
        return self.running.runtime

    def supervised_pids(self) -> set[int]:
        pids = {self.daemon.models.default.decoder.pid}
        for provider in self.daemon.models.default.parts.providers.all:
            child = provider.child
            if child is not None:
                pids.add(child.pid)
        return {pid for pid in pids if pid is not None}

    async def decoder_slots(self) -> list[dict[str, Any]]:
        reply = await self.direct.get("/slots")
        found: list[dict[str, Any]] = reply.json() if reply.status_code == 200 else []
        return found

    async def wait_decoder_busy(self) -> int:
        while True:  # the decoder's state: another process's, polled
            try:
                busy = [s["id"] for s in await self.decoder_slots() if s["is_processing"]]
            except (httpx.HTTPError, ValueError):
                busy = []
            if busy:
                return int(busy[0])
            await trio.sleep(0.02)

    async def wait_decoder_back(self, generation: int) -> None:
        decoder = self.daemon.models.default.decoder
        while not (decoder.generation > generation and decoder.state is ChildState.READY):
            await decoder.wait_state(ChildState.READY, ChildState.BACKOFF, ChildState.STARTING)
            if decoder.generation <= generation or decoder.state is not ChildState.READY:
                await trio.sleep(0.05)  # the next transition

    async def line(self, back: int = 1) -> dict[str, Any]:
        """The route line of the ``back``-th last request, once every request in flight logged its own
        (the line is written after the last byte reached the client)."""
        await self.daemon.front.registry.wait_idle()
        return self.lines[-back]

    def leftovers(self) -> list[str]:
        found: list[str] = []
        allowed = self.supervised_pids()
        for pid in list(allowed):
            allowed |= set(children_of(pid))
        stray = {pid: cmd for pid, cmd in children_of(os.getpid()).items() if pid not in allowed}
        found += [f"process {pid}: {cmd}" for pid, cmd in stray.items()]
        state = self.runtime / "state"
        if state.is_dir():
            found += [f"state file {p.name}" for p in state.iterdir()]
        expected = {"decoder.sock", "admin.sock", "onebitd.lock", "state"}
        for path in self.runtime.iterdir():
            if path.name not in expected and not (path.name.startswith("provider-") and path.name.endswith(".sock")):
                found.append(f"runtime file {path.name}")
        return found


class RouteLines(logging.Handler):
    def __init__(self, into: list[dict[str, Any]]) -> None:
        super().__init__(logging.INFO)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "route_fields", None)
        if isinstance(fields, dict):
            self.into.append(fields)


def chaos_config(runtime: Path, *, parallel: int = 2, ctx_per_slot: int = 512, **sections: Any) -> Config:
    data = configuration.unstructure(Config())
    data["server"].update(port=0, runtime_dir=str(runtime), shutdown_grace_s=10.0)
    data["model"].update(parallel=parallel, ctx_size=parallel * ctx_per_slot)
    data["decoder"].update(threads=1, health=dict(HEALTH), restart=dict(RESTART))
    data["hybrid"]["enabled"] = False
    # No prefix store and no host cache: each request's work is its own, and state/ holds only what
    # a request in flight put there.
    data["cache"].update(enabled=False, ram_mib=0)
    for section, values in sections.items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    return configuration.structure(data, "chaos")


def provider_spec(kind: str, base: Config, work: Path) -> dict[str, Any]:
    """A real provider of ``kind``: a llama-server, or one wrapped as an exec program or a worker."""
    health = {"health": dict(HEALTH), "restart": dict(RESTART)}
    if kind == "llama-server":
        return {"kind": "llama-server", "name": "p0", "threads": 1, **health}
    binary = locate.llama_server(base.decoder.binary)
    model = locate.model_path(base.model.path)
    if binary is None or model is None:
        raise ChaosError("no llama-server or model: run scripts/setup")
    args = [*model_args(base.model, model), "-t", "1"]
    if kind == "exec":
        command = [sys.executable, str(TESTS / "llama_exec_provider.py"), str(binary), *args]
        # The decoder's own build, whose state is exact: admitted unmeasured, as a user would say.
        return {"kind": "exec", "name": "p0", "command": command, "fidelity_check": False}
    state = Path(base.server.runtime_dir) / "state"
    command = [sys.executable, str(TESTS / "llama_worker_provider.py"), str(binary), str(state), str(work), *args]
    return {"kind": "worker", "name": "p0", "command": command, "fidelity_check": False, **health}


def hybrid_config(runtime: Path, kind: str, work: Path, **sections: Any) -> Config:
    base = chaos_config(runtime, **sections)
    hybrid = {
        "enabled": True,
        "min_prompt_tokens": 16,
        "prefill_timeout_s": PREFILL_TIMEOUT_S,
        "route_by": "length",  # every long prompt is handed over: the faults are in the handoff
    }
    return chaos_config(runtime, hybrid=hybrid, provider=[provider_spec(kind, base, work)], **sections)


@asynccontextmanager
async def open_onebitd(config: Config, tally: Tally) -> AsyncIterator[Onebitd]:
    """onebitd in this trio run; on the way out, its leftovers (running, then stopped) go to ``tally``."""
    runtime = Path(config.server.runtime_dir)
    lines: list[dict[str, Any]] = []
    handler = RouteLines(lines)
    route_log = logging.getLogger(ROUTE_LOGGER)
    route_log.addHandler(handler)
    every_pid: set[int] = set()
    try:
        async with (
            run_daemon(config, providers_ready=True, ready_timeout_s=300) as running,
            running.clients(request_timeout_s=REQUEST_BOUND_S, direct_timeout_s=60, max_connections=512) as clients,
        ):
            od = Onebitd(running, clients, lines)
            yield od
            every_pid |= od.supervised_pids()
            with trio.move_on_after(60):
                await od.daemon.front.registry.wait_idle()
            tally.leftovers += od.leftovers()
            every_pid |= set(children_of(os.getpid()))
    finally:
        route_log.removeHandler(handler)
    # Its children must be reaped; their own children (a worker's llama-server), killed with their
    # process group, must be gone: dead, if perhaps not yet reaped by init, which adopted them.
    ours = set(children_of(os.getpid()))
    with trio.move_on_after(5):
        while any(not gone(pid) for pid in every_pid):  # noqa: ASYNC110  # other processes' exits
            await trio.sleep(0.05)
    for pid in sorted(every_pid):
        if pid in ours or not gone(pid):
            tally.leftovers.append(f"pid {pid} still there after onebitd stopped")
    if children_of(os.getpid()):
        tally.leftovers.append(f"processes after onebitd stopped: {children_of(os.getpid())}")
    state = runtime / "state"
    if state.is_dir() and not os.path.ismount(state):  # noqa: ASYNC240
        tally.leftovers += [f"state file {p.name} after stop" for p in state.iterdir()]


@attrs.frozen
class Run:
    quick: bool
    base: Path  # a short directory under /tmp for this run

    def dir(self, name: str) -> Path:
        path = self.base / name
        path.mkdir(parents=True, exist_ok=True)
        return path


Scenario = Callable[[Run, Tally], Awaitable[None]]


# -- 1. the decoder hangs --------------------------------------------------------------------------


async def decoder_hang(run: Run, tally: Tally) -> None:
    """SIGSTOP the decoder mid-stream, then mid-prefill: the streams end with an error event within
    HANG_BOUND_S (+ slack), requests sent meanwhile get a clean error, then every request succeeds."""
    async with open_onebitd(chaos_config(run.dir("hang"), parallel=2), tally) as od:
        for phase in ("mid-stream", "mid-prefill"):
            generation = od.daemon.models.default.decoder.generation
            pid = od.daemon.models.default.decoder.pid
            assert pid is not None
            prompt = SHORT if phase == "mid-stream" else " ".join(f"w{i}" for i in range(150))
            body = body_for(prompt, stream=True, tokens=200)
            ended: list[float] = []
            async with trio.open_nursery() as nursery:
                first_token = trio.Event()

                async def one_stream(
                    body: dict[str, Any] = body, first: trio.Event = first_token, ended: list[float] = ended
                ) -> None:
                    events: list[str] = []
                    with trio.move_on_after(REQUEST_BOUND_S):
                        async with od.front.stream("POST", COMPLETIONS, json=body) as reply:
                            async for line in reply.aiter_lines():
                                if line.startswith("data:"):
                                    events.append(line[5:].strip())
                                    first.set()
                    ended.append(trio.current_time())
                    verdict, note = judge_events(events, None)
                    if verdict == "ok":
                        verdict, note = "bad", "a stream that outlived a hung decoder"
                    tally.add(verdict if events else "lost", note or "no event")

                nursery.start_soon(one_stream)
                if phase == "mid-stream":
                    await first_token.wait()
                else:
                    await od.wait_decoder_busy()
                async with stopped(pid):
                    hung_at = trio.current_time()
                    # Requests sent to a hung decoder: a clean error once it is killed, or a 503.
                    for _ in range(2):
                        nursery.start_soon(ask_and_count, od.front, tally, body_for(SHORT, stream=False, tokens=4))
                    await od.wait_decoder_back(generation)
            tally.check(bool(ended) and ended[0] - hung_at <= HANG_BOUND_S + SLACK_S, f"{phase}: stream ended in time")
            tally.figures[f"{phase} stream ended after s"] = round(ended[0] - hung_at, 2) if ended else None
            took = await ask_until_ok(od.front, tally, body_for(SHORT, stream=False, tokens=4), bound=60)
            tally.figures[f"{phase} next ok after s"] = round(took, 2)


async def ask_and_count(client: httpx.AsyncClient, tally: Tally, body: dict[str, Any]) -> None:
    verdict, note, _ = await ask(client, body)
    tally.add(verdict, note)


# -- 2. the decoder is killed during a restore, and during the first request after a restart ------


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


async def decoder_kill(run: Run, tally: Tally) -> None:
    """kill -9 the decoder during a restore, then during the first request after its restart."""
    config = hybrid_config(run.dir("kill"), "llama-server", run.dir("kill-work"))
    async with open_onebitd(config, tally) as od:
        hybrid = od.daemon.models.default.parts.hybrid
        assert hybrid is not None
        killer = RestoreKiller(hybrid.file.client, od)
        hybrid.file.client = killer
        generation = od.daemon.models.default.decoder.generation
        verdict, note, _ = await ask(od.front, body_for(LONG, stream=False, tokens=4))
        tally.add(verdict, note)
        tally.check(not killer.armed, "a restore was asked (the kill happened)")
        await od.wait_decoder_back(generation)
        # The first request after the restart, killed once the decoder works on it.
        generation = od.daemon.models.default.decoder.generation
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask_and_count, od.front, tally, body_for(SHORT, stream=True, tokens=200))
            await od.wait_decoder_busy()
            pid = od.daemon.models.default.decoder.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
        await od.wait_decoder_back(generation)
        for prompt in (fresh(LONG, "after the restarts"), SHORT):
            await ask_until_ok(od.front, tally, body_for(prompt, stream=False, tokens=4), bound=60)
        tally.check((await od.line(2))["route"] == "file", "the hybrid route again after the restarts")


# -- 3. a provider is killed, and stopped, mid-job ------------------------------------------------


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


def provider_fault(kind: str) -> Scenario:
    async def scenario(run: Run, tally: Tally) -> None:
        config = hybrid_config(run.dir(f"prov-{kind}"), kind, run.dir(f"prov-{kind}-work"))
        async with open_onebitd(config, tally) as od:
            await ask_until_ok(od.front, tally, body_for(LONG, stream=False, tokens=4), bound=REQUEST_BOUND_S)
            tally.check((await od.line())["route"] == "file", "the first long prompt takes the file route")
            for fault in ("SIGKILL", "SIGSTOP"):
                child = od.daemon.models.default.parts.providers.all[0].child
                generation = child.generation if child is not None else 0
                result: list[tuple[str, str, int]] = []
                async with trio.open_nursery() as nursery:

                    async def one(result: list[tuple[str, str, int]] = result, fault: str = fault) -> None:
                        result.append(await ask(od.front, body_for(fresh(LONG, fault), stream=False, tokens=4)))

                    nursery.start_soon(one)
                    pid = await wait_provider_job(od)
                    faulted_at = trio.current_time()
                    if fault == "SIGKILL":
                        os.kill(pid, signal.SIGKILL)
                        await nursery_done(result)
                        took = trio.current_time() - faulted_at
                    else:
                        async with stopped(pid):
                            await nursery_done(result)
                            took = trio.current_time() - faulted_at
                            if child is not None:
                                # Its health checks fail (a worker's pings go unanswered): killed, restarted.
                                with trio.move_on_after(HANG_BOUND_S + SLACK_S + PROVIDER_START_S) as waited:
                                    await provider_ready(od, generation)
                                restarted = not waited.cancelled_caught and provider_pid(od) not in (None, pid)
                                tally.check(restarted, "SIGSTOP: the stopped provider is killed and restarted")
                                tally.figures["SIGSTOP to restarted (ready) s"] = round(
                                    trio.current_time() - faulted_at, 2
                                )
                verdict, note, _ = result[0]
                tally.add(verdict, note)
                line = await od.line()
                tally.check(line["route"] == "plain", f"{fault}: the request went plain ({line['route']})")
                tally.check("provider-failed" in (line["fallback"] or ""), f"{fault}: fallback says provider-failed")
                tally.check(took <= PREFILL_TIMEOUT_S + SLACK_S, f"{fault}: plain within prefill_timeout_s")
                tally.figures[f"{fault} answered after s"] = round(took, 2)
                if child is not None:
                    await provider_ready(od, generation)
                await ask_until_ok(
                    od.front, tally, body_for(fresh(LONG, f"again {fault}"), stream=False, tokens=4), bound=120
                )
                tally.check((await od.line())["route"] == "file", f"after {fault}: the file route again")

    scenario.__doc__ = f"kill -9 and SIGSTOP the {kind} provider mid-job"
    return scenario


async def nursery_done(result: list[Any]) -> None:
    while not result:  # noqa: ASYNC110  # set by the request's own task in the same nursery
        await trio.sleep(0.02)


# -- 4. the state directory fills up --------------------------------------------------------------


async def disk_full(run: Run, tally: Tally) -> None:
    """state/ on a 64 KiB tmpfs: the state write fails, the request goes plain, nothing half-written."""
    runtime = run.dir("full")
    state = runtime / "state"
    state.mkdir(exist_ok=True)
    # A state file of this prompt is ~23 KiB per token: 64 KiB holds none of them.
    mounted = await trio.run_process(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(state)], capture_stderr=True, check=False
    )
    if mounted.returncode != 0:
        raise Skipped(f"cannot mount a tmpfs (needs root and CAP_SYS_ADMIN): {mounted.stderr.decode().strip()}")
    try:
        async with open_onebitd(hybrid_config(runtime, "llama-server", run.dir("full-work")), tally) as od:
            for stream in (False, True):
                verdict, note, _ = await ask(od.front, body_for(fresh(LONG, stream), stream=stream, tokens=4))
                tally.add(verdict, note)
                line = await od.line()
                tally.check(line["route"] == "plain", "a full disk: the request went plain")
                tally.check(line["fallback"] == "provider-failed", f"the route line says why ({line['fallback']})")
                tally.check(list(state.iterdir()) == [], "nothing half-written is left in state/")
            tally.figures["route line fallback"] = (await od.line())["fallback"]
    finally:
        with trio.CancelScope(shield=True):
            await trio.run_process(["umount", "-l", str(state)], check=False)


# -- 5. clients: hang-ups, slow readers, a burst past the queue ------------------------------------


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


async def hang_ups(run: Run, tally: Tally) -> None:
    """Clients that hang up at random moments: queueing, prefill, restore, streaming."""
    n = 30 if run.quick else 100
    config = hybrid_config(run.dir("hangup"), "llama-server", run.dir("hangup-work"), parallel=2)
    rng = random.Random(10)
    async with open_onebitd(config, tally) as od:
        limiter = trio.CapacityLimiter(6)

        async def one(i: int) -> None:
            async with limiter:
                prompt = LONG + f" {i}" if i % 2 else SHORT + f" {i}"
                await hang_up_after(od, body_for(prompt, stream=i % 3 != 0, tokens=16), rng.uniform(0, 3.0))
                tally.add("hung_up")

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        with trio.fail_after(REQUEST_BOUND_S):
            await od.daemon.front.registry.wait_idle()
        tally.check(len(od.lines) == n, f"one route line per request ({len(od.lines)} of {n})")
        outcomes: dict[str, int] = {}
        for line in od.lines:
            outcomes[line["outcome"]] = outcomes.get(line["outcome"], 0) + 1
        tally.figures["outcomes"] = outcomes
        for prompt in (LONG, SHORT):
            for stream in (False, True):
                verdict, note, _ = await ask(
                    od.front, body_for(fresh(prompt, f"after {stream}"), stream=stream, tokens=4)
                )
                tally.add(verdict, note)


async def slow_readers(run: Run, tally: Tally) -> None:
    """Clients reading a long stream slowly: onebitd must not buffer what they have not read."""
    n = 6 if run.quick else 20
    tokens = 96 if run.quick else 400
    config = chaos_config(run.dir("slow"), parallel=n, ctx_per_slot=tokens + 128)
    async with open_onebitd(config, tally) as od:
        await ask_until_ok(od.front, tally, body_for(SHORT, stream=True, tokens=4), bound=60)
        before = rss_mib()
        peak = before
        received: list[int] = []

        async def reader(i: int) -> None:
            # A small receive buffer and 1 KiB every 0.1 s: the stream arrives far faster than it is read.
            body = body_for(f"{SHORT} {i}", stream=True, tokens=tokens, n_probs=5)
            events = b""
            with trio.move_on_after(REQUEST_BOUND_S * 2):
                async with await open_raw(od, rcvbuf=4096) as raw:
                    await raw.send_all(raw_request(COMPLETIONS, body))
                    while chunk := await raw.receive_some(1024):
                        events += chunk
                        await trio.sleep(0.1)
                received.append(len(events))
                head, _, rest = events.partition(b"\r\n\r\n")
                datas = [
                    line[5:].strip().decode()
                    for line in rest.replace(b"\r\n", b"\n").split(b"\n")
                    if line.startswith(b"data:")
                ]
                verdict, note = judge_events(datas, None) if b" 200 " in head[:16] else ("bad", head[:60].decode())
                tally.add(verdict, note)
                return
            tally.add("lost", "a slow reader's stream never ended")

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(reader, i)

            async def watch() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, rss_mib())
                    await trio.sleep(0.2)

            nursery.start_soon(watch)
            while len(received) + tally.lost < n:  # noqa: ASYNC110
                await trio.sleep(0.2)  # the readers' progress: plain counters, polled
            nursery.cancel_scope.cancel()
        streamed = sum(received) / 2**20
        tally.figures.update(
            rss_before_mib=round(before, 1),
            rss_peak_mib=round(peak, 1),
            streamed_mib=round(streamed, 2),
        )
        tally.check(peak - before <= RSS_TOLERANCE_MIB, f"RSS grew {peak - before:.1f} MiB while clients read slowly")


current_req: contextvars.ContextVar[str] = contextvars.ContextVar("current_req", default="")


async def burst(run: Run, tally: Tally) -> None:
    """300 requests at once against queue_limit 64: the overflow gets 503 with Retry-After at once,
    everything admitted completes, and slots are handed out in arrival order."""
    n, queue_limit = 300, 64
    config = chaos_config(run.dir("burst"), parallel=2, server={"queue_limit": queue_limit})
    async with open_onebitd(config, tally) as od:
        completions = od.daemon.models.default.completions
        slots = completions.slots
        arrived: list[str] = []
        granted: list[str] = []
        serve, hold = completions.serve, slots.hold

        async def counting_serve(endpoint: str, body: dict[str, Any], out: Any, story: Any, headers: Any = ()) -> None:
            current_req.set(story.req)
            arrived.append(story.req)
            await serve(endpoint, body, out, story, headers)

        @asynccontextmanager
        async def recording_hold(*args: Any, **kwargs: Any) -> AsyncIterator[int]:
            async with hold(*args, **kwargs) as slot:
                granted.append(current_req.get())
                yield slot

        completions.serve = counting_serve  # type: ignore[method-assign]
        slots.hold = recording_hold  # type: ignore[method-assign]
        refused_s: list[float] = []
        try:
            async with trio.open_nursery() as nursery:

                async def one() -> None:
                    started = trio.current_time()
                    verdict, note, status = await ask(od.front, body_for(SHORT, stream=False, tokens=2))
                    tally.add(verdict, note)
                    if status == 503:
                        refused_s.append(trio.current_time() - started)

                for i in range(n):
                    nursery.start_soon(one)
                    while len(arrived) < i + 1:  # noqa: ASYNC110  # one at a time: arrival order is sending order
                        await trio.sleep(0.001)
        finally:
            completions.serve = serve  # type: ignore[method-assign]
            slots.hold = hold  # type: ignore[method-assign]
        # Recorded once the grant is seen by its task, which trio may schedule a little out of turn
        # among the requests granted at one release: FIFO within `parallel` places.
        position = {req: i for i, req in enumerate(req for req in arrived if req in set(granted))}
        displaced = max((abs(position[req] - i) for i, req in enumerate(granted)), default=0)
        tally.check(displaced <= config.model.parallel, f"slots granted in arrival order (displaced {displaced})")
        tally.figures["most places a grant was out of arrival order"] = displaced
        tally.check(len(refused_s) == tally.clean, "every clean error was a 503")
        tally.check(tally.ok + tally.clean == n, "every request answered")
        tally.check(len(refused_s) > 0, "the burst overflowed the queue")
        tally.check(max(refused_s, default=0) < 5.0, "the overflow was refused at once")
        tally.figures.update(admitted=tally.ok, refused=len(refused_s), slowest_refusal_s=round(max(refused_s), 3))


# -- 6. the cancelled-prefill slot -----------------------------------------------------------------


async def cancelled_prefill(run: Run, tally: Tally) -> None:
    """A client leaves during a long prefill; llama-server finishes that prefill.  The next request
    (whose prompt shares the abandoned one's start, so slot affinity prefers that slot) must not wait
    behind it: its first token comes before the decoder lets go of the abandoned slot."""
    words = 60 if run.quick else 200
    abandoned = LONG + " " + " ".join(f"item{i}" for i in range(words))
    # Small batches: llama-server interleaves another slot's prompt with the long prefill.
    config = chaos_config(
        run.dir("cprefill"), parallel=2, ctx_per_slot=2048, model={"batch_size": 32, "ubatch_size": 32}
    )
    async with open_onebitd(config, tally) as od:
        # Warm slot 0 so that the abandoned prompt lands on slot 1 (least recently used), and the
        # next request's other slot is 0, whose prompt llama-server batches first.
        await ask_until_ok(od.front, tally, body_for(SHORT, stream=False, tokens=2), bound=60)
        idle_at: list[float] = []
        first_token_at: list[float] = []
        async with trio.open_nursery() as nursery:

            async def leave() -> None:
                with trio.CancelScope() as scope:
                    async with od.front.stream("POST", COMPLETIONS, json=body_for(abandoned, stream=True, tokens=4)):
                        busy = await od.wait_decoder_busy()
                        tally.figures["abandoned slot"] = busy
                        scope.cancel()
                tally.add("hung_up")

            await leave()
            left_at = trio.current_time()

            async def watch_idle() -> None:
                while any(s["is_processing"] for s in await od.decoder_slots() if s["id"] == 1):  # noqa: ASYNC110
                    await trio.sleep(0.02)  # the decoder's slots: another process's state
                idle_at.append(trio.current_time())

            async def next_request() -> None:
                body = body_for(LONG + " next", stream=True, tokens=2)
                events: list[str] = []
                async with od.front.stream("POST", COMPLETIONS, json=body) as reply:
                    async for line in reply.aiter_lines():
                        if line.startswith("data:"):
                            if not first_token_at:
                                first_token_at.append(trio.current_time())
                            events.append(line[5:].strip())
                verdict, note = judge_events(events, 2)
                tally.add(verdict, note)

            nursery.start_soon(watch_idle)
            nursery.start_soon(next_request)
        ttft = first_token_at[0] - left_at
        remaining = idle_at[0] - left_at
        tally.figures.update(next_ttft_s=round(ttft, 2), abandoned_prefill_left_s=round(remaining, 2))
        await od.daemon.front.registry.wait_idle()
        # The abandoned request logs its line last: it holds its slot until the decoder lets go.
        tally.figures["next request's slot"] = [line for line in od.lines if line["outcome"] == "ok"][-1]["slot"]
        tally.check(
            tally.figures["next request's slot"] != tally.figures["abandoned slot"],
            "the next request took the other slot",
        )
        tally.check(ttft < remaining, "the next request's first token came before the abandoned prefill ended")


# -- 7. a soak ------------------------------------------------------------------------------------


async def soak(run: Run, tally: Tally) -> None:
    """Mixed requests (plain and file, streamed and whole, 5% hang-ups): fds, RSS, runtime dir after."""
    n = 200 if run.quick else 5000
    config = hybrid_config(run.dir("soak"), "llama-server", run.dir("soak-work"), parallel=4)
    rng = random.Random(7)
    async with open_onebitd(config, tally) as od:
        for prompt in (LONG, SHORT):  # warm: the pools, the rates
            await ask_until_ok(od.front, tally, body_for(prompt, stream=True, tokens=4), bound=120)
        fd_before, rss_before = fds(), rss_mib()
        limiter = trio.CapacityLimiter(6)

        async def one(i: int) -> None:
            async with limiter:
                prompt = (LONG if rng.random() < 0.5 else SHORT) + f" {i}"
                body = body_for(prompt, stream=rng.random() < 0.5, tokens=rng.choice((2, 4, 8)), chat=False)
                if rng.random() < 0.05:
                    await hang_up_after(od, {**body, "stream": True}, rng.uniform(0, 2.0))
                    tally.add("hung_up")
                    return
                verdict, note, _ = await ask(od.front, body)
                tally.add(verdict, note)

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        with trio.fail_after(REQUEST_BOUND_S):
            await od.daemon.front.registry.wait_idle()
        fd_after, rss_after = fds(), rss_mib()
        routes: dict[str, int] = {}
        for line in od.lines:
            routes[line["route"] or "none"] = routes.get(line["route"] or "none", 0) + 1
        tally.figures.update(
            fds=f"{fd_before} -> {fd_after}",
            rss_mib=f"{rss_before:.1f} -> {rss_after:.1f}",
            routes=routes,
        )
        tally.check(fd_after - fd_before <= FD_TOLERANCE, f"fd drift {fd_after - fd_before} within {FD_TOLERANCE}")
        tally.check(rss_after - rss_before <= RSS_TOLERANCE_MIB, f"RSS drift within {RSS_TOLERANCE_MIB} MiB")


# -- 8. malformed HTTP ----------------------------------------------------------------------------


async def fuzz(run: Run, tally: Tally) -> None:
    """A hypothesis-driven fuzz of heads and bodies; a good request keeps being served meanwhile."""

    config = chaos_config(
        run.dir("fuzz"),
        server={"max_body_bytes": 65536, "body_timeout_s": 1.0, "idle_timeout_s": 1.0},
        # A wrong-typed max_tokens falls back to llama-server's default: keep that short.
        decoder={"extra_args": ["-n", "4"]},
    )
    async with open_onebitd(config, tally) as od:
        await fuzz_front(od, tally, examples=60 if run.quick else 600)


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


async def fuzz_front(od: Onebitd, tally: Tally, *, examples: int) -> None:
    # chaos/fuzz.py: hypothesis is a test dependency, imported only for this scenario.
    from chaos.fuzz import judge, run_cases

    statuses: dict[str, int] = {}
    done = trio.Event()

    def record(kind: str, raw: bytes, status: int | None, closed: bool) -> None:
        key = f"{kind} {status if status is not None else 'closed'}"
        statuses[key] = statuses.get(key, 0) + 1
        tally.add(*judge(kind, raw, status, closed))

    async def keep_serving() -> None:
        served = 0
        while not done.is_set():
            verdict, note, _ = await ask(od.front, body_for(SHORT, stream=served % 2 == 1, tokens=2), bound=120)
            tally.add(verdict, note)
            served += 1
            with trio.move_on_after(0.5):
                await done.wait()
        tally.figures["good requests served meanwhile"] = served

    async with trio.open_nursery() as nursery:
        nursery.start_soon(keep_serving)
        try:
            await trio.to_thread.run_sync(run_cases, examples, partial(send_case, od), record)
        finally:
            done.set()
    tally.figures["answers"] = dict(sorted(statuses.items()))
    health = await od.front.get("/health")
    tally.check(health.status_code == 200, "onebitd healthy after the fuzz")


# -- the command line ------------------------------------------------------------------------------

SCENARIOS: dict[str, Scenario] = {
    "decoder-hang": decoder_hang,
    "decoder-kill": decoder_kill,
    "provider-llama-server": provider_fault("llama-server"),
    "provider-exec": provider_fault("exec"),
    "provider-worker": provider_fault("worker"),
    "disk-full": disk_full,
    "hang-ups": hang_ups,
    "slow-readers": slow_readers,
    "burst": burst,
    "cancelled-prefill": cancelled_prefill,
    "soak": soak,
    "fuzz": fuzz,
}


def report(name: str, tally: Tally, seconds: float) -> None:
    verdict = "FAIL" if tally.failed else "skip" if tally.skipped else "ok"
    print(
        f"{name:<22} {verdict:<4} sent {tally.sent:>4}  correct {tally.ok:>4}  clean error {tally.clean:>3}  "
        f"lost {tally.lost}  bad {tally.bad}  hung up {tally.hung_up:>3}  left behind {len(tally.leftovers)}  "
        f"({seconds:.0f}s)"
    )
    if tally.skipped:
        print(f"    skipped: {tally.skipped}")
    for key, value in tally.figures.items():
        print(f"    {key}: {value}")
    for note in tally.notes + [f"left behind: {x}" for x in tally.leftovers]:
        print(f"    {note}")
    sys.stdout.flush()


async def main_async(args: argparse.Namespace) -> int:
    names = args.only or list(SCENARIOS)
    base = Path(tempfile.mkdtemp(prefix="ob-chaos-", dir="/tmp"))
    failed = False
    try:
        run = Run(args.quick, base)
        for name in names:
            tally = Tally()
            started = time.monotonic()
            fd_start = fds()
            with trio.move_on_after(args.time_limit) as limit:
                try:
                    await SCENARIOS[name](run, tally)
                    if not tally.sent:
                        tally.notes.append("failed: the scenario sent no request")
                except Skipped as exc:
                    tally.skipped = str(exc)
                except Exception as exc:  # a scenario's own bug or a broken guarantee: reported, not raised
                    tally.notes.append(f"failed: {type(exc).__name__}: {exc!r}"[:2000])
                    traceback.print_exception(exc, file=sys.stderr)  # where it came from, in full
            if limit.cancelled_caught:
                tally.notes.append(f"failed: over the time limit of {args.time_limit:g}s")
            if fds() > fd_start + 2:
                tally.leftovers.append(f"fds: {fd_start} before the scenario, {fds()} after onebitd stopped")
            report(name, tally, time.monotonic() - started)
            failed |= tally.failed
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the short form (the test suite's)")
    parser.add_argument("--only", action="append", choices=sorted(SCENARIOS), help="this scenario (repeatable)")
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds per scenario (default 900)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--log", default=os.environ.get("CHAOS_LOG", ""), help="onebitd's log goes here")
    args = parser.parse_args()
    if args.list:
        for name, scenario in SCENARIOS.items():
            print(f"{name:<22} {(scenario.__doc__ or '').strip().splitlines()[0]}")
        return 0
    if locate.llama_server("") is None:
        print("scripts/chaos: no llama-server; run scripts/setup", file=sys.stderr)
        return 2
    logging.basicConfig(filename=args.log or os.devnull, level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        return trio.run(main_async, args)
    except ChaosError as exc:
        print(f"scripts/chaos: {exc}", file=sys.stderr)
        return 2
