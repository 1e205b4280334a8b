"""The benchmarks' shared rig: onebitd as each benchmark runs it, the clients it measures with, and
the machine it runs on, and the route lines onebitd logs meanwhile (:func:`open_lines`).

onebitd runs in a process of its own (:func:`spawn_onebitd`, as in service) or in the benchmark's
own trio run with a hybrid route and its provider (:func:`open_rig`); :func:`open_direct` starts a
llama-server of its own beside it, the side that measures without onebitd.  The machine line
(:func:`machine`) and :class:`Noise` (the CPU other processes took meanwhile) go with every run's
figures, so that two runs' figures can be compared.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import platform
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TextIO

import attrs
import httpx
import tomli_w
import trio

from supervisor import config as configuration
from supervisor.config import Config, locate
from supervisor.daemon import Daemon
from supervisor.observe.logs import ROUTE_LOGGER
from supervisor.providers.llama import LlamaServerProvider
from supervisor.routeline import FIELDS
from supervisor.supervise.process import ChildProcess
from supervisor.testing import RouteLines, run_daemon, unix_transport

ROOT = Path(__file__).resolve().parent.parent

# Loading SmolLM2 takes about a second; a busy 2-core machine can take far longer.
READY_TIMEOUT_S = 300
# One request never takes this long on this model; past it, something is stuck, not slow.
REQUEST_TIMEOUT_S = 300
READ_REST_S = 5.0  # what a spawned onebitd wrote last, read after it stopped
# The hybrid rig's start and requests: one 2k-token prefill on a loaded 2-core machine is seconds, not minutes.
HYBRID_TIMEOUT_S = 600
# The direct llama-server's start (its model loading beside a daemon's own).
DIRECT_TIMEOUT_S = 900


class BenchError(Exception):
    """A request failed or the daemon did not come up: the figures would mean nothing."""


def bench_config(
    runtime_dir: Path, *, parallel: int, ctx_size: int, threads: int, decoder_cpus: Sequence[int] = ()
) -> Config:
    """onebitd's defaults (the embedded model, the plain route) on port 0 under ``runtime_dir``."""
    data = configuration.unstructure(Config())
    data["server"].update(port=0, runtime_dir=str(runtime_dir), shutdown_grace_s=10.0)
    data["cache"]["dir"] = str(runtime_dir / "prefix")  # never the user's own store
    data["model"].update(parallel=parallel, ctx_size=ctx_size)
    data["decoder"]["threads"] = threads
    data["decoder"]["cpu_affinity"] = list(decoder_cpus)
    data["hybrid"]["enabled"] = False  # the plain route: what is measured is the relay itself
    config = configuration.structure(data, "bench")
    configuration.check(config, "bench")
    return config


@attrs.frozen
class Spawned:
    """onebitd as it runs in service: its own process (``python -m supervisor.daemon``), its own core."""

    pid: int
    decoder_pid: int | None
    url: str
    front: httpx.AsyncClient
    direct: httpx.AsyncClient


def _within(data: dict[str, Any], shape: dict[str, Any]) -> dict[str, Any]:
    return {
        key: _within(value, shape[key]) if isinstance(value, dict) and isinstance(shape[key], dict) else value
        for key, value in data.items()
        if key in shape
    }


@asynccontextmanager
async def spawn_onebitd(
    config: Config,
    runtime_dir: Path,
    log: TextIO,
    *,
    root: Path = ROOT,
    shape: dict[str, Any] | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> AsyncIterator[Spawned]:
    """onebitd in a process of its own, ready (its sd_notify READY=1, every provider started: one
    that is not is a BenchError), and the two clients; ``root``: the checkout whose onebitd it is
    (``versus`` runs another's beside this one).

    The benchmark's clients then share neither onebitd's event loop nor its CPU time, as an
    OpenAI client and onebitd do in service.  The process is stopped (SIGTERM) and reaped when the
    block ends, and it stops and reaps its decoder."""
    config_path = runtime_dir / "onebit.toml"
    written = configuration.unstructure(config)
    if shape is not None:  # another checkout: only the keys its config knows (one added since is an error there)
        written = _within(written, shape)
    config_path.write_text(tomli_w.dumps(written))
    notify_path = runtime_dir / "notify.sock"
    notify = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    await notify.bind(str(notify_path))
    python_path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH", "")]))
    env = {**os.environ, "NOTIFY_SOCKET": str(notify_path), "PYTHONPATH": python_path}
    argv = [sys.executable, "-m", "supervisor.daemon", "--config", str(config_path)]
    with notify:
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(
                functools.partial(
                    trio.run_process,
                    argv,
                    stdout=log,
                    stderr=log,
                    env=env,
                    # `python -m` puts its working directory first on the path, before PYTHONPATH: run
                    # in ``root``, or a checkout's onebitd could import the package of whatever
                    # directory the benchmark was started in (every "other tree" run did, once).
                    cwd=str(root),
                    check=False,
                    deliver_cancel=stop_onebitd,
                )
            )
            try:
                url, not_ready = "", ""
                with trio.move_on_after(ready_timeout_s):
                    while not url:
                        message = (await notify.recv(4096)).decode()
                        fields = dict(line.split("=", 1) for line in message.splitlines() if "=" in line)
                        if fields.get("READY") == "1":
                            # "serving on URL[, URL...][; providers not ready: NAME, ...]"
                            serving, _, not_ready = fields.get("STATUS", "").partition("; ")
                            url = serving.removeprefix("serving on ").split(",")[0].strip()
                if not url:
                    raise BenchError(f"onebitd (pid {process.pid}) did not say READY=1 in {ready_timeout_s:.0f} s")
                if not_ready:
                    raise BenchError(f"onebitd (pid {process.pid}) is ready with {not_ready}: its log says why")
                # Keep reading what onebitd says (STATUS= every few seconds), as systemd does.
                nursery.start_soon(drain, notify)
                timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
                limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
                transport = unix_transport(runtime_dir / "decoder.sock")
                async with (
                    httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as front,
                    httpx.AsyncClient(transport=transport, base_url="http://decoder", timeout=timeout) as direct,
                ):
                    yield Spawned(process.pid, child_pid(process.pid), url, front, direct)
            finally:
                if process.returncode is None:
                    with trio.CancelScope(shield=True):
                        await stop_onebitd(process)
                nursery.cancel_scope.cancel()  # the drain


async def drain(notify: trio.socket.SocketType) -> None:
    while True:
        await notify.recv(4096)


async def stop_onebitd(process: trio.Process) -> None:
    """SIGTERM, and the time onebitd needs to stop its decoder (trio's own default kills after 5 s,
    which would leave the decoder to its parent-death signal); SIGKILL only past that."""
    process.send_signal(signal.SIGTERM)
    with trio.move_on_after(READY_TIMEOUT_S):
        await process.wait()
        return
    process.kill()


def child_pid(pid: int) -> int | None:
    """``pid``'s one child (onebitd's decoder, the plain route having no provider), from /proc."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if len(children) == 1 else None


def process_cpu_s(pid: int) -> float:
    """CPU seconds ``pid`` has run, all its threads, to the nanosecond (/proc/PID/task/*/schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def rss_of(pid: int | str) -> float:
    """``pid``'s resident memory in MiB (``"self"``: this process's), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def decoder_version(config: Config) -> str:
    binary = locate.llama_server(config.decoder.binary)
    if binary is None:
        return "llama-server (not found)"
    result = await trio.run_process([str(binary), "--version"], capture_stdout=True, capture_stderr=True)
    words = (result.stdout + result.stderr).decode(errors="replace").split()
    version = words[words.index("version:") + 1] if "version:" in words else "unknown"
    return f"llama-server {version} ({locate.LLAMA_CPP_VERSION} from scripts/setup): {binary}"


def machine() -> str:
    """The CPU as the kernel tells it, with family, model and clock: a VM's model name ("AMD EPYC") is
    the same for every generation, and onebitd's CPU per request differs by 2x between them."""
    cpu = platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            name, _, value = line.partition(":")
            if not name.strip():
                break  # the first CPU's block is enough
            fields.setdefault(name.strip(), value.strip())
    cpu = fields.get("model name", cpu)
    if "cpu family" in fields:
        cpu += f", family {fields['cpu family']} model {fields.get('model', '?')}"
    if "cpu MHz" in fields:
        cpu += f", {float(fields['cpu MHz']):.0f} MHz"
    usable = len(os.sched_getaffinity(0))
    return (
        f"{usable} CPUs ({cpu}), {platform.system()} {platform.release()}, Python {platform.python_version()}; "
        f"python probe {python_probe_ms():.1f} ms"
    )


def python_probe_ms() -> float:
    """A fixed pure-Python workload (dict stores, str(), a loop: onebitd's kind of code), the best of
    five runs: how fast this machine runs Python, to compare the CPU figures of two machines by."""
    best = math.inf
    for _ in range(5):
        started = time.perf_counter()
        table: dict[int, str] = {}
        for i in range(200_000):
            table[i & 1023] = str(i)
        best = min(best, time.perf_counter() - started)
    return best * 1000


def busy_ticks() -> int:
    """Clock ticks all CPUs spent on anything but idling, since boot (Linux /proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return user + nice + system + irq + softirq + steal


def process_ticks(pid: int | None) -> int:
    """Clock ticks ``pid`` ran (user + system); 0 when it is gone."""
    if pid is None:
        return 0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return int(fields[11]) + int(fields[12])  # utime, stime: the stat(5) fields 14 and 15


def tree_ticks() -> int:
    """Clock ticks this process ran, with its reaped children and every live descendant."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    own = sum(int(field) for field in fields[11:15])  # utime, stime, cutime, cstime
    return own + sum(process_ticks(pid) for pid in descendants(os.getpid()))


def descendants(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


@attrs.frozen
class Noise:
    """The CPU other processes took while we measured: it slows both sides, not always equally.

    Our own use (the clients, onebitd, the decoder) is left out: on a small machine it is the
    contention being measured."""

    others: int
    started: float

    @classmethod
    def start(cls, ours: Sequence[int | None]) -> Noise:
        return cls(cls._others(ours), time.monotonic())

    @staticmethod
    def _others(ours: Sequence[int | None]) -> int:
        """``ours`` empty: this process's whole tree (its children may come and go: a crashed
        decoder's ticks stay in ours once it is reaped)."""
        return busy_ticks() - (sum(process_ticks(pid) for pid in ours) if ours else tree_ticks())

    def report(self, ours: Sequence[int | None]) -> str:
        seconds = time.monotonic() - self.started
        # Clamped: ticks are sampled at slightly different moments, so an idle machine can come out at -0.
        cpus = max(0.0, (self._others(ours) - self.others) / os.sysconf("SC_CLK_TCK") / seconds)
        verdict = "   (a busy machine: treat the figures as noise)" if cpus > 0.1 * (os.cpu_count() or 1) else ""
        return f"machine noise: other processes used {cpus:.2f} of {os.cpu_count()} CPUs during the run{verdict}"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: a value that was actually measured."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def print_table(rows: Sequence[tuple[str, float, float]], unit_width: int = 12) -> None:
    """``measure  direct  onebitd  onebitd/direct``, one row per measure."""
    label_width = max(len(label) for label, _, _ in rows) + 2
    print(f"{'measure':<{label_width}}{'direct':>{unit_width}}{'onebitd':>{unit_width}}{'onebitd/direct':>16}")
    for label, direct, front in rows:
        ratio = front / direct if direct else float("nan")
        print(f"{label:<{label_width}}{direct:>{unit_width}.2f}{front:>{unit_width}.2f}{ratio:>16.3f}")


def leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found += leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return found


@attrs.frozen
class Rig:
    """onebitd in this trio run with the file route and one llama-server provider, and a client on
    each of its front, its decoder and its provider."""

    daemon: Daemon
    front: httpx.AsyncClient
    decoder: httpx.AsyncClient
    provider: httpx.AsyncClient


@asynccontextmanager
async def open_rig(config: Config, *, check_fidelity: bool = True) -> AsyncIterator[Rig]:
    async with (
        run_daemon(
            config, check_fidelity=check_fidelity, providers_ready=True, ready_timeout_s=HYBRID_TIMEOUT_S
        ) as running,
        # httpx's own pool limits for the front, as before the harness.
        running.clients(request_timeout_s=HYBRID_TIMEOUT_S, max_connections=100, keepalive=20) as clients,
    ):
        (provider,) = running.daemon.models.default.parts.providers.all
        assert isinstance(provider, LlamaServerProvider)
        # As onebitd's own client: keep-alive connections retired before llama-server's 5 s idle
        # close (a bare transport reuses one at that moment: "Server disconnected without sending
        # a response").
        provider_t = unix_transport(provider.launcher.socket)
        async with httpx.AsyncClient(
            transport=provider_t, base_url="http://p", timeout=HYBRID_TIMEOUT_S
        ) as provider_client:
            yield Rig(running.daemon, clients.front, clients.direct, provider_client)


def provider_of(rig: Rig) -> LlamaServerProvider:
    (provider,) = rig.daemon.models.default.parts.providers.all
    assert isinstance(provider, LlamaServerProvider)
    return provider


@asynccontextmanager
async def open_direct(daemon: Daemon, config: Config, directory: Path) -> AsyncIterator[Path]:
    """The direct side: a llama-server of its own with the decoder's flags (its binary, model, slots,
    threads and CPU), on its own socket, so that no request of onebitd's ever takes its slots.  The
    sides run turn by turn, never at once, so sharing the decoder's CPU costs neither anything."""
    argv = list(daemon.models.default.parts.launcher.argv())
    socket, state = directory / "direct.sock", directory / "direct-state"
    state.mkdir(mode=0o700, parents=True)
    argv[argv.index("--host") + 1] = str(socket)
    argv[argv.index("--slot-save-path") + 1] = str(state)
    process = await ChildProcess.spawn(
        "direct", argv, env=daemon.models.default.parts.launcher.env, cpu_affinity=config.decoder.cpu_affinity
    )
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(process.pump_output)
            async with httpx.AsyncClient(transport=unix_transport(socket), base_url="http://direct") as client:
                with trio.fail_after(DIRECT_TIMEOUT_S):
                    while True:  # a process of its own loading its model: poll its health
                        try:
                            if (await client.get("/health")).status_code == 200:
                                break
                        except httpx.TransportError:
                            pass
                        await trio.sleep(0.05)
            yield socket
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await process.stop(grace=5)


async def writes_settled(daemon: Daemon) -> None:
    """The prefix store's writes run off the requests' path: wait until none is left."""
    stored = daemon.models.default.completions.stored
    while stored is not None and stored.writing:  # noqa: ASYNC110  # no event announces it
        await trio.sleep(0.01)


@asynccontextmanager
async def open_lines() -> AsyncIterator[RouteLines]:
    """Every route line logged while the block runs."""
    lines = RouteLines()
    logger = logging.getLogger(ROUTE_LOGGER)
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)


@asynccontextmanager
async def piped_lines(keep: TextIO) -> AsyncIterator[tuple[TextIO, RouteLines]]:
    """A pipe to give :func:`spawn_onebitd` as its log (its config's ``log.format`` ``"json"``), and
    the route lines that onebitd logs into it, read as they come: what :func:`open_lines` is for an
    onebitd in this process.  Every line is copied to ``keep``, and its warnings and errors to this
    process's standard error, as an onebitd in this process logs them.

    Enter it before ``spawn_onebitd``: the pipe is read until onebitd has stopped (and what it
    wrote last, for at most :data:`READ_REST_S`), so its writes never block on a pipe nobody reads."""
    lines = RouteLines()
    finished = trio.Event()
    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "w") as writer:
        async with trio.lowlevel.FdStream(read_fd) as reader, trio.open_nursery() as nursery:
            nursery.start_soon(_read_log, reader, keep, lines, finished)
            try:
                yield writer, lines
            finally:
                writer.close()  # onebitd has stopped: the pipe ends once what it wrote is read
                with trio.move_on_after(READ_REST_S, shield=True):
                    await finished.wait()
                nursery.cancel_scope.cancel()


async def _read_log(reader: trio.lowlevel.FdStream, keep: TextIO, lines: RouteLines, finished: trio.Event) -> None:
    pending = b""
    async for chunk in reader:
        *whole, pending = (pending + chunk).split(b"\n")
        for raw in whole:
            text = raw.decode(errors="replace")
            keep.write(text + "\n")
            try:
                record = json.loads(text)
            except ValueError:
                continue  # a line not of the JSON log: a child's own output, a traceback's
            if not isinstance(record, dict):
                continue
            if record.get("logger") == ROUTE_LOGGER:
                lines.add({key: record[key] for key in FIELDS if key in record})
            elif record.get("level") in ("warning", "error", "critical"):
                print(text, file=sys.stderr)
    finished.set()
