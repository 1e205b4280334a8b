"""``scripts/bench overhead``: latency and token rate through onebitd against the same llama-server
reached straight over its unix socket, both sides measured alternately in one run.

onebitd runs in a process of its own, as in service (``--onebitd inline`` puts it in this one,
beside the clients; ``--trace`` needs that); (a) short completions in alternating pairs, (b) rounds
of concurrent streams; then the ratios against their aims, onebitd's CPU per request and per relayed
chunk, and its memory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TextIO

import attrs
import httpx
import trio

from bench import plot, trace
from bench.rig import (
    READY_TIMEOUT_S,
    REQUEST_TIMEOUT_S,
    Noise,
    bench_config,
    decoder_version,
    machine,
    percentile,
    print_table,
    process_cpu_s,
    rss_of,
    spawn_onebitd,
)
from bench.workloads import Side, load_arguments, load_bodies, relay_figures, short_completion, stream_round
from supervisor.config import Config, locate
from supervisor.daemon import Daemon
from supervisor.observe import logs
from supervisor.testing import run_daemon


def arguments(parser: argparse.ArgumentParser) -> None:
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
    tracer: trace.Tracer | None


async def run(args: argparse.Namespace) -> int:
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
        plot.write(
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
    tracer = trace.Tracer() if args.trace else None
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
    tracer: trace.Tracer | None,
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
        trace.report("direct", direct.records, None)
        trace.report("through onebitd", front.records, measured.tracer)
