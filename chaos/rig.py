"""onebitd under test as the chaos scenarios run it: its config (fast health checks and restarts),
the providers of each kind, the daemon in this trio run with its route lines (:class:`Onebitd`),
and what was left behind once it stopped (processes, fds, memory).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from chaos.traffic import REQUEST_BOUND_S, Tally
from supervisor import config as configuration
from supervisor.config import Config, locate
from supervisor.daemon import Daemon
from supervisor.llama.llama_server import connection_limit, model_args
from supervisor.observe.logs import ROUTE_LOGGER
from supervisor.supervise.child import ChildState
from supervisor.testing import Clients, Running, run_daemon

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
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


class ChaosError(Exception):
    """A set-up problem: the figures would mean nothing."""


class Skipped(Exception):
    """A scenario that cannot run on this machine; the message says why.  Reported as ``skip``."""


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
        command = [sys.executable, str(TESTS / "rigs" / "llama_exec_provider.py"), str(binary), *args]
        # The decoder's own build, whose state is exact: admitted unmeasured, as a user would say.
        return {"kind": "exec", "name": "p0", "command": command, "fidelity_check": False}
    state = Path(base.server.runtime_dir) / "state"
    command = [
        sys.executable,
        str(TESTS / "rigs" / "llama_worker_provider.py"),
        str(binary),
        str(state),
        str(work),
        *args,
    ]
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
