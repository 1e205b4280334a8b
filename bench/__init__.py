"""onebit's benchmarks: what onebitd costs on top of the llama-server it supervises.

    scripts/bench overhead [--quick]   latency and token rate: through onebitd vs straight to llama-server
    scripts/bench handoff [--quick]    the file route vs the plain route, and decode isolation
    scripts/bench providers [--quick]  first token: plain vs the file route on a ggml and an OpenVINO provider
    scripts/bench multiturn [--quick]  chats over many turns: plain, hybrid, llama-server direct
    scripts/bench prefix [--quick]     a long shared prompt across a decoder crash, with and without the store
    scripts/bench models [--quick]     two models through a one-model budget: swaps, with and without the store
    scripts/bench families [--quick]   per model family and quant: first token plain vs the file route, memory
    scripts/bench agent [--quick]      an agent's session through anthropic-python and openai-python's Responses
                                       client: direct, plain, hybrid, and after a full restart
    scripts/bench hosts [--quick]      agents' sessions over three hosts behind HAProxy, one drained half way:
                                       affinity by conversation against the round-robin it replaced

Each also takes ``--plot FILE.svg``: its figures drawn as one picture as well (bench/plot.py).

Every subcommand runs onebitd (port 0, a runtime directory under /tmp), waits until its decoder is
ready, measures, then stops the daemon, which stops and reaps its children, whatever happened (an
error, Ctrl-C, SIGTERM).  ``overhead`` runs it in a process of its own, as in service (``--onebitd
inline`` puts it in this one, beside the clients); the others run it in this process.  Figures are
ratios against the same llama-server reached directly in the same run, so that the machine's speed,
and most of its noise, cancels out; nothing here passes or fails on speed.  Exit status: 0 when
every request succeeded, 1 otherwise, 2 for a set-up problem.

Adding a subcommand: write an ``arguments(parser)`` function and an ``async run(args) -> int``
coroutine (use supervisor/testing.py's ``run_daemon`` and ``Running.clients`` for the daemon and its
two clients) that, given ``--plot``, hands its samples to ``bench_plot.write`` as panels, and add one
:class:`Subcommand` line to ``SUBCOMMANDS`` at the bottom.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TextIO

import attrs
import httpx
import tomli_w
import trio

from bench import agent as bench_agent
from bench import families as bench_families
from bench import handoff as bench_handoff
from bench import hosts as bench_hosts
from bench import models as bench_models
from bench import multiturn as bench_multiturn
from bench import plot as bench_plot
from bench import prefix as bench_prefix
from bench import providers as bench_providers
from bench import trace as bench_trace
from bench import versus as bench_versus
from supervisor import config as configuration
from supervisor.config import Config, locate
from supervisor.daemon import Daemon
from supervisor.errors import ChildError, ConfigError
from supervisor.observe import logs
from supervisor.testing import run_daemon, unix_transport

ROOT = Path(__file__).resolve().parent.parent

# Loading SmolLM2 takes about a second; a busy 2-core machine can take far longer.
READY_TIMEOUT_S = 300
# One request never takes this long on this model; past it, something is stuck, not slow.
REQUEST_TIMEOUT_S = 300


class BenchError(Exception):
    """A request failed or the daemon did not come up: the figures would mean nothing."""


# -- the daemon and its two clients ----------------------------------------------------------------


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
    config: Config, runtime_dir: Path, log: TextIO, *, root: Path = ROOT, shape: dict[str, Any] | None = None
) -> AsyncIterator[Spawned]:
    """onebitd in a process of its own, ready (its sd_notify READY=1), and the two clients; ``root``:
    the checkout whose onebitd it is (``versus`` runs another's beside this one).

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
                url = ""
                with trio.move_on_after(READY_TIMEOUT_S):
                    while not url:
                        message = (await notify.recv(4096)).decode()
                        fields = dict(line.split("=", 1) for line in message.splitlines() if "=" in line)
                        if fields.get("READY") == "1":
                            url = fields.get("STATUS", "").removeprefix("serving on ").split(",")[0].strip()
                if not url:
                    raise BenchError(f"onebitd (pid {process.pid}) did not say READY=1 in {READY_TIMEOUT_S} s")
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


# -- numbers ---------------------------------------------------------------------------------------


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


# -- overhead --------------------------------------------------------------------------------------

PROMPT = "The capital of France is"


def load_arguments(parser: argparse.ArgumentParser, *, pairs: int, rounds: int) -> None:
    """The load both ``overhead`` and ``versus`` put on each side: (a) short completions, (b) streams."""
    parser.add_argument("--quick", action="store_true", help="a handful of requests: checks it runs, not speed")
    parser.add_argument("--pairs", type=int, default=pairs, help="alternating request pairs for (a)")
    parser.add_argument("--warmup", type=int, default=10, help="pairs for (a) before measuring")
    parser.add_argument("--max-tokens", type=int, default=2, help="tokens per short completion in (a)")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams in (b)")
    parser.add_argument("--stream-tokens", type=int, default=128, help="tokens per stream in (b)")
    parser.add_argument("--rounds", type=int, default=rounds, help="rounds per side for (b)")
    parser.add_argument("--parallel", type=int, default=8, help="decoder slots (model.parallel)")


def load_bodies(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(a)'s request and (b)'s streams; ``--quick`` makes them a handful."""
    if args.quick:
        args.pairs, args.warmup, args.rounds, args.stream_tokens = 10, 2, 1, 16
    short = {"prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0, "seed": 42}
    # ignore_eos: every stream produces exactly stream_tokens tokens, on both sides.
    streams = [
        {
            "prompt": f"Story number {i}. Once upon a time",
            "max_tokens": args.stream_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        for i in range(args.streams)
    ]
    return short, streams


def overhead_arguments(parser: argparse.ArgumentParser) -> None:
    load_arguments(parser, pairs=200, rounds=5)
    parser.add_argument(
        "--ctx-size", type=int, default=0, help="decoder context, shared by the slots (0: 256 a slot, at least 2048)"
    )
    parser.add_argument("--threads", type=int, default=0, help="decoder threads (0: llama-server's default)")
    parser.add_argument("--log", metavar="FILE", help="keep onebitd's log here (default: discarded)")
    parser.add_argument(
        "--decoder-cpus", type=cpu_list, default=(), metavar="LIST", help="pin the decoder (decoder.cpu_affinity)"
    )
    parser.add_argument(
        "--self-cpus", type=cpu_list, default=(), metavar="LIST", help="pin this process (onebitd and the clients)"
    )
    parser.add_argument(
        "--onebitd",
        choices=("process", "inline"),
        default="process",
        help="onebitd in its own process, as in service (default), or in this one, beside the clients",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="print one stream round per side as a per-request timeline (runs onebitd inline)",
    )
    parser.add_argument(
        "--page-feed",
        action="store_true",
        help="keep the status page's feed (/onebit/events) open and read throughout, as an open page does",
    )


def cpu_list(text: str) -> tuple[int, ...]:
    """``0`` or ``0,1``: CPU numbers, as ``taskset -c`` takes them (without ranges)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of CPU numbers: {text!r} (for example 0 or 0,1)") from None


@attrs.define
class Side:
    """What one side (direct, or through onebitd) measured."""

    latencies: list[float] = attrs.Factory(list)  # seconds per short completion
    tokens: int = 0  # streamed tokens, all rounds
    seconds: float = 0.0  # wall time of the stream rounds
    first_tokens: list[float] = attrs.Factory(list)  # seconds to each stream's first token
    round_rates: list[float] = attrs.Factory(list)  # tokens/s of each stream round
    events: int = 0  # streamed events received, all rounds (one per chunk llama-server writes)
    short_cpu: float = 0.0  # this process's CPU seconds during the side's short completions
    stream_cpu: float = 0.0  # and during its stream rounds
    records: list[bench_trace.StreamRecord] = attrs.Factory(list)  # the last round's streams

    @property
    def token_rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


async def short_completion(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    side: Side | None = None,
    cpu: Callable[[], float] = time.process_time,
) -> float:
    cpu_before, start = cpu(), time.perf_counter()
    reply = await client.post("/v1/completions", json=body)
    elapsed = time.perf_counter() - start
    if side is not None:
        side.short_cpu += cpu() - cpu_before
    if reply.status_code != 200:
        raise BenchError(f"{client.base_url} answered {reply.status_code}: {reply.text[:300]}")
    return elapsed


async def one_stream(client: httpx.AsyncClient, body: dict[str, Any], start: float, side: Side) -> None:
    tokens = events = 0
    counted: int | None = None
    record = bench_trace.StreamRecord(key=body["prompt"], sent=start)
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise BenchError(f"{client.base_url} answered {reply.status_code} to a stream")
        async for line in reply.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            events += 1
            if "error" in event:
                raise BenchError(f"{client.base_url} ended a stream with an error: {event['error']}")
            if tokens == 0:
                record.first = time.perf_counter()
                side.first_tokens.append(record.first - start)
            tokens += 1
            usage = event.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                counted = usage["completion_tokens"]
            timings = event.get("timings")
            if isinstance(timings, dict):
                record.timings = timings
    # The decoder's own count; the events are a fallback (the last one carries no token).
    side.tokens += counted if counted is not None else tokens
    side.events += events
    side.records.append(record)


async def stream_round(
    client: httpx.AsyncClient,
    bodies: Sequence[dict[str, Any]],
    side: Side,
    cpu: Callable[[], float] = time.process_time,
) -> None:
    side.records.clear()
    cpu_before, start, tokens_before = cpu(), time.perf_counter(), side.tokens
    async with trio.open_nursery() as nursery:
        for body in bodies:
            nursery.start_soon(one_stream, client, body, start, side)
    seconds = time.perf_counter() - start
    side.stream_cpu += cpu() - cpu_before
    side.seconds += seconds
    side.round_rates.append((side.tokens - tokens_before) / seconds)


@attrs.frozen
class Target:
    """What the overhead benchmark measures against: onebitd's clients, and how to read its cost."""

    front: httpx.AsyncClient
    direct: httpx.AsyncClient
    cpu: Callable[[], float]  # onebitd's CPU seconds so far (inline: this whole process's)
    rss: Callable[[], float]  # onebitd's RSS in MiB (inline: this whole process's)
    ours: Callable[[], tuple[int, ...]]  # the pids whose CPU is the measurement's, not noise
    what: str  # what cpu and rss cover, for the printed lines
    daemon: Daemon | None = None  # inline only (--trace patches it)


@asynccontextmanager
async def open_target(
    args: argparse.Namespace, config: Config, runtime_dir: Path, log: TextIO
) -> AsyncIterator[Target]:
    if args.onebitd == "inline":
        # onebitd logs as it does in service (route lines, the decoder's output): that work counts.
        logs.setup("logfmt", "info", stream=log)
        try:
            async with (
                run_daemon(config, ready_timeout_s=READY_TIMEOUT_S) as running,
                running.clients(request_timeout_s=REQUEST_TIMEOUT_S) as clients,
            ):
                daemon = running.daemon
                yield Target(
                    clients.front,
                    clients.direct,
                    cpu=time.process_time,
                    rss=lambda: rss_of("self"),
                    ours=lambda: (
                        os.getpid(),
                        *((daemon.models.default.decoder.pid,) if daemon.models.default.decoder.pid else ()),
                    ),
                    what="this process (onebitd and the clients)",
                    daemon=daemon,
                )
        finally:
            logs.setup("logfmt", "warning")  # off the log file before it goes
        return
    async with spawn_onebitd(config, runtime_dir, log) as spawned:
        pid = spawned.pid
        yield Target(
            spawned.front,
            spawned.direct,
            cpu=lambda: process_cpu_s(pid),
            rss=lambda: rss_of(pid),
            ours=lambda: (os.getpid(), pid, *((spawned.decoder_pid,) if spawned.decoder_pid else ())),
            what=f"the onebitd process (pid {pid})",
        )


def cpu_lines(direct: Side, front: Side, requests: int, streams: int, what: str) -> list[str]:
    """onebitd's CPU: what was measured on the onebitd side beyond the direct side.

    Both sides run the same clients and the same onebitd (idle on the direct side but for its
    health checks), so the difference is onebitd's work on the requests: HTTP in (supervisor/http/server.py), the
    relay, the decoder client, logging.  Per chunk, the stream rounds' share of the per-request
    cost (measured in (a)) is taken out first."""
    per_request = (front.short_cpu - direct.short_cpu) / requests if requests else float("nan")
    relayed = front.events
    per_chunk = (front.stream_cpu - direct.stream_cpu - per_request * streams) / relayed if relayed else float("nan")
    lines = [
        f"cpu, {what}: (a) direct side {direct.short_cpu:.3f} s, onebitd side {front.short_cpu:.3f} s; "
        f"(b) direct side {direct.stream_cpu:.3f} s, onebitd side {front.stream_cpu:.3f} s",
        f"onebitd cpu: {per_request * 1000:.2f} s per 1000 requests   "
        f"{per_chunk * 1000:.3f} s per 1000 relayed chunks ({relayed} chunks)",
    ]
    if not what.startswith("this process") and requests:
        # What onebitd spends while the requests go straight to the decoder (its health checks, and
        # reading and logging the decoder's output about them) is in neither figure above; it is
        # paid for every request in service too.
        lines.append(f"onebitd cpu while the requests went direct: {direct.short_cpu / requests * 1000:.2f} s per 1000")
    return lines


@attrs.frozen
class Measured:
    """What one overhead run measured on both sides, for :func:`report_overhead`."""

    direct: Side
    front: Side
    what: str  # what the CPU and RSS figures cover
    rss_before: float
    rss_after: float
    noise: str  # the other processes' share of the machine, as a line
    tracer: bench_trace.Tracer | None


async def overhead(args: argparse.Namespace) -> int:
    """``scripts/bench overhead``: the set-up said, both sides measured alternately, the ratios."""
    short, streams = load_bodies(args)
    if args.trace and args.onebitd != "inline":
        print("scripts/bench: --trace patches the daemon's objects: onebitd runs inline", file=sys.stderr)
        args.onebitd = "inline"
    ctx_size = args.ctx_size or max(2048, 256 * args.parallel)
    runtime_dir = Path(tempfile.mkdtemp(prefix="ob-bench-", dir="/tmp"))
    try:
        config = bench_config(
            runtime_dir, parallel=args.parallel, ctx_size=ctx_size, threads=args.threads, decoder_cpus=args.decoder_cpus
        )
        if args.self_cpus:
            os.sched_setaffinity(0, args.self_cpus)
        await print_setup(args, config, ctx_size)
        log_path = Path(args.log) if args.log else runtime_dir / "onebitd.log"
        with log_path.open("w") as log:
            async with open_target(args, config, runtime_dir, log) as target, trio.open_nursery() as nursery:
                feed = PageFeed()
                if args.page_feed:
                    await nursery.start(feed.read, target.front)
                measured = await measure(args, target, short, streams)
                nursery.cancel_scope.cancel()
            if args.page_feed:
                print(f"page feed: open throughout, {feed.events} events read ({feed.lines} route lines)")
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)
    report_overhead(args, measured)
    if args.plot:
        bench_plot.write(
            args.plot,
            "scripts/bench overhead",
            relay_figures({"direct": measured.direct, "onebitd": measured.front}),
            quick=args.quick,
        )
    return 0


@attrs.define
class PageFeed:
    """The status page's feed read as an open page reads it: every event, as it comes."""

    events: int = 0
    lines: int = 0

    async def read(self, front: httpx.AsyncClient, *, task_status: trio.TaskStatus[None]) -> None:
        async with front.stream("GET", "/onebit/events", timeout=None) as reply:
            if reply.status_code != 200:
                raise SystemExit(f"scripts/bench: /onebit/events answered {reply.status_code}")
            task_status.started()
            async for line in reply.aiter_lines():
                if line.startswith("event: "):
                    self.events += 1
                    self.lines += line == "event: line"


def relay_figures(sides: dict[str, Side]) -> list[bench_plot.Panel]:
    """``overhead``'s and ``versus``'s figures: each side's latencies and first tokens as distributions,
    its token rate round by round."""
    return [
        bench_plot.Distribution(
            "(a) short completions: latency",
            "ms",
            {name: [s * 1000 for s in side.latencies] for name, side in sides.items()},
            log_x=True,  # the body within a few ms, a loaded machine's tail seconds out
        ),
        bench_plot.Distribution(
            "(b) concurrent streams: first token",
            "ms",
            {name: [s * 1000 for s in side.first_tokens] for name, side in sides.items()},
        ),
        bench_plot.Bars(
            "(b) concurrent streams: aggregate token rate, round by round",
            "tokens/s",
            {
                f"round {r + 1}": {name: side.round_rates[r : r + 1] for name, side in sides.items()}
                for r in range(max(len(side.round_rates) for side in sides.values()))
            },
        ),
    ]


async def print_setup(args: argparse.Namespace, config: Config, ctx_size: int) -> None:
    """What runs where, and what each part of the run sends."""
    model = locate.model_path(config.model.path)
    print("onebit overhead: onebitd over HTTP vs the same llama-server straight over its unix socket")
    print(f"machine: {machine()}")
    print(f"decoder: {await decoder_version(config)}")
    print(
        f"model: {model.name if model else '?'}, ctx_size {ctx_size}, parallel {args.parallel}, "
        f"threads {args.threads or 'default'}"
    )
    print(
        "onebitd: "
        + (
            "in this process, sharing its event loop with the clients"
            if args.onebitd == "inline"
            else "its own process (python -m supervisor.daemon), as in service"
        )
    )
    if args.decoder_cpus or args.self_cpus:
        print(
            f"pinned: decoder on CPUs {args.decoder_cpus or 'any'}, "
            f"onebitd and the clients on {args.self_cpus or 'any'}"
        )
    print(
        f"(a) short completions, not streamed: {args.pairs} alternating pairs after {args.warmup} warm-up, "
        f"max_tokens {args.max_tokens}"
    )
    print(
        f"(b) {args.streams} concurrent streams x {args.stream_tokens} tokens, "
        f"{args.rounds} alternating round(s) per side after 1 warm-up"
    )
    sys.stdout.flush()


async def measure(
    args: argparse.Namespace, target: Target, short: dict[str, Any], streams: list[dict[str, Any]]
) -> Measured:
    """(a) then (b), each side in turn, with onebitd's RSS before and after and the machine's noise."""
    direct, front = Side(), Side()
    tracer = bench_trace.Tracer() if args.trace else None
    if tracer is not None and target.daemon is not None:
        tracer.install(target.daemon)
    rss_before = target.rss()
    noise = Noise.start(target.ours())
    await short_pairs(args, target, short, direct, front)
    await stream_rounds(args, target, streams, direct, front, tracer)
    noise_line = noise.report(target.ours())
    return Measured(direct, front, target.what, rss_before, target.rss(), noise_line, tracer)


async def short_pairs(
    args: argparse.Namespace, target: Target, short: dict[str, Any], direct: Side, front: Side
) -> None:
    """(a): short completions in pairs, one per side, after the warm-up ones."""
    for i in range(args.warmup + args.pairs):
        measured = i >= args.warmup
        # Alternate who goes first, so neither side always meets a just-warmed decoder.
        pairs = [(target.direct, direct), (target.front, front)]
        latencies = {}
        for client, side in pairs[::-1] if i % 2 else pairs:
            latencies[client] = await short_completion(client, short, side if measured else None, target.cpu)
        if measured:
            front.latencies.append(latencies[target.front])
            direct.latencies.append(latencies[target.direct])


async def stream_rounds(
    args: argparse.Namespace,
    target: Target,
    streams: list[dict[str, Any]],
    direct: Side,
    front: Side,
    tracer: bench_trace.Tracer | None,
) -> None:
    """(b): a warm-up round per side, then rounds of concurrent streams, the sides alternating."""
    await stream_round(target.direct, streams, Side(), target.cpu)
    await stream_round(target.front, streams, Side(), target.cpu)
    for r in range(args.rounds):
        order = [(target.front, front), (target.direct, direct)]
        for client, side in order if r % 2 else order[::-1]:
            if tracer is not None and client is target.front:
                tracer.clear()
            await stream_round(client, streams, side, target.cpu)


def verdict(met: bool) -> str:
    return "met" if met else "not met"


def report_overhead(args: argparse.Namespace, measured: Measured) -> None:
    """The table, the ratios against their aims, and what onebitd's CPU and memory came to."""
    direct, front = measured.direct, measured.front
    direct_median, front_median = statistics.median(direct.latencies), statistics.median(front.latencies)
    print()
    print_table(
        [
            ("(a) latency median, ms", direct_median * 1000, front_median * 1000),
            ("(a) latency p99, ms", percentile(direct.latencies, 99) * 1000, percentile(front.latencies, 99) * 1000),
            ("(b) aggregate tokens/s", direct.token_rate, front.token_rate),
            (
                "(b) first token median, ms",
                statistics.median(direct.first_tokens) * 1000,
                statistics.median(front.first_tokens) * 1000,
            ),
        ]
    )
    added_ms = (front_median - direct_median) * 1000
    added_p99 = (percentile(front.latencies, 99) - percentile(direct.latencies, 99)) * 1000
    rate = front.token_rate / direct.token_rate
    first = statistics.median(front.first_tokens) / statistics.median(direct.first_tokens)
    # Rounds r of each side ran back to back: their ratio is the least exposed to drift in the load.
    paired = statistics.median(f / d for f, d in zip(front.round_rates, direct.round_rates, strict=True))
    print()
    print(f"added at the median: {added_ms:+.2f} ms   (aim: at most 1 ms; {verdict(added_ms <= 1)})")
    print(f"added at the p99: {added_p99:+.2f} ms   (aim: at most 3 ms; {verdict(added_p99 <= 3)})")
    print(f"token rate: {rate:.3f}x direct   (aim: at least 0.98x; {verdict(rate >= 0.98)})")
    print(f"token rate, median of paired rounds: {paired:.3f}x direct")
    print(f"first token median: {first:.2f}x direct   (aim: at most 1.2x; {verdict(first <= 1.2)})")
    for name, side in (("direct", direct), ("onebitd", front)):
        print(f"(b) rounds, tokens/s, {name}: {' '.join(f'{rate:.1f}' for rate in side.round_rates)}")
        firsts = sorted(side.first_tokens)
        print(
            f"(b) first token, ms, {name}: min {firsts[0] * 1000:.1f}  median {statistics.median(firsts) * 1000:.1f}  "
            f"max {firsts[-1] * 1000:.1f}"
        )
    for line in cpu_lines(direct, front, len(front.latencies), args.streams * args.rounds, measured.what):
        print(line)
    print(f"rss, {measured.what}: {measured.rss_before:.1f} MiB before, {measured.rss_after:.1f} MiB after")
    print(measured.noise)
    if args.trace:
        print()
        bench_trace.report("direct", direct.records, None)
        bench_trace.report("through onebitd", front.records, measured.tracer)


# -- the command line ------------------------------------------------------------------------------


def versus_arguments(parser: argparse.ArgumentParser) -> None:
    load_arguments(parser, pairs=300, rounds=4)
    bench_versus.arguments(parser)


@attrs.frozen
class Subcommand:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], Awaitable[int]]


SUBCOMMANDS = [
    Subcommand(
        name="overhead",
        help="latency and token rate through onebitd vs straight to llama-server",
        arguments=overhead_arguments,
        run=overhead,
    ),
    Subcommand(
        name="handoff",
        help="the file route against the plain route: prefill, save, restore, first byte, decode isolation",
        arguments=bench_handoff.arguments,
        run=lambda args: bench_handoff.run(args, sys.modules[__name__]),
    ),
    Subcommand(
        name="providers",
        help="first token: plain against the file route with a ggml and with an OpenVINO provider",
        arguments=bench_providers.arguments,
        run=bench_providers.run,
    ),
    Subcommand(
        name="families",
        help="per model family and quant: first token plain against the file route, the restore, memory",
        arguments=bench_families.arguments,
        run=bench_families.run,
    ),
    Subcommand(
        name="multiturn",
        help="chats re-sending their conversation every turn: plain, hybrid and llama-server direct",
        arguments=bench_multiturn.arguments,
        run=lambda args: bench_multiturn.run(args, sys.modules[__name__]),
    ),
    Subcommand(
        name="prefix",
        help="a long shared prompt across a decoder crash, with the prefix store and without",
        arguments=bench_prefix.arguments,
        run=bench_prefix.run,
    ),
    Subcommand(
        name="agent",
        help="an agent's session through anthropic-python and the Responses client: direct, plain, hybrid, restarted",
        arguments=bench_agent.arguments,
        run=lambda args: bench_agent.run(args, sys.modules[__name__]),
    ),
    Subcommand(
        name="models",
        help="two models through max_loaded = 1: swapped-back turns with the prefix store and without, a burst",
        arguments=bench_models.arguments,
        run=bench_models.run,
    ),
    Subcommand(
        name="hosts",
        help="agents' sessions over three hosts behind HAProxy, one drained: affinity against round-robin",
        arguments=bench_hosts.arguments,
        run=lambda args: bench_hosts.run(args, sys.modules[__name__]),
    ),
    Subcommand(
        name="versus",
        help="onebitd from this tree against onebitd from another checkout, side by side: CPU and latency",
        arguments=versus_arguments,
        run=lambda args: bench_versus.run(args, sys.modules[__name__]),
    ),
]


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="scripts/bench", description=(__doc__ or "").split("\n\n")[0])
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in SUBCOMMANDS:
        sub = commands.add_parser(command.name, help=command.help, description=command.help)
        command.arguments(sub)
        bench_plot.add_argument(sub)
        sub.set_defaults(subcommand=command)
    return top


async def run(args: argparse.Namespace) -> int:
    """The chosen subcommand, cut short by SIGTERM as by Ctrl-C: the daemon still stops and reaps."""
    subcommand: Subcommand = args.subcommand
    status = 143  # 128 + SIGTERM, unless the subcommand finishes
    async with trio.open_nursery() as nursery:

        async def on_sigterm() -> None:
            with trio.open_signal_receiver(signal.SIGTERM) as signals:
                async for _ in signals:
                    print("scripts/bench: SIGTERM: stopping", file=sys.stderr)
                    nursery.cancel_scope.cancel()

        nursery.start_soon(on_sigterm)
        started = time.time()
        status = await subcommand.run(args)
        nursery.cancel_scope.cancel()
    # A picture from an earlier run does not count (its mtime is before this one's start; 1 s for
    # file systems that keep whole seconds).
    if args.plot and not (args.plot.is_file() and args.plot.stat().st_mtime >= started - 1):
        raise BenchError(f"{subcommand.name} drew no picture at {args.plot}: its run() does not pass --plot on")
    return status


def leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found += leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return found


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.plot:
        try:
            bench_plot.check()  # now, not after a run of minutes
        except bench_plot.PlotError as problem:
            print(f"scripts/bench: {problem}", file=sys.stderr)
            return 2
    status = 1
    # The subcommand runs inside nurseries: what it raises arrives as an exception group.
    try:
        status = trio.run(run, args)
    except* ConfigError as group:
        for exc in leaves(group):
            for line in exc.lines if isinstance(exc, ConfigError) else [str(exc)]:
                print(f"scripts/bench: {line}", file=sys.stderr)
        status = 2
    except* (BenchError, ChildError) as group:  # ChildError: the decoder failed to start
        for exc in leaves(group):
            print(f"scripts/bench: {exc}", file=sys.stderr)
        status = 1
    except* KeyboardInterrupt:
        status = 130
    return status
