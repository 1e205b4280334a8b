"""``scripts/bench multiturn``: chats that re-send their whole conversation every turn.

N chats (default 3) of T turns (default 6), interleaved turn by turn, each with its own ~600-token
system prompt, streamed, through three sides up at once and measured request by request:

    (a) onebitd with hybrid off (the plain route)
    (b) onebitd with the default hybrid config (a llama-server provider, the file route, the cost
        decision); with ``--aa``, a second onebitd with hybrid off: the A/A run
    (c) a llama-server of its own with (a)'s decoder flags, reached over its socket (it picks its
        own slots by prompt similarity)

Each chat's turn is asked of the three sides one after another, the order rotating request by
request and reversed every other cycle, so that each side goes first, second and third alike and
the machine's drift falls on all three; after an onebitd side's request the bench waits for its
route line and the prefix store's write, so the next side runs on a quiet machine.  Each side
answers one unmeasured request of its own first (its first request pays for warming up, not the
route).  Every side sees the same prompts: a chat's conversation is kept per side, since each
side's replies become its next prompt.

Per turn: time to first token (median over the chats), the prompt tokens the decoder evaluated, and
on (b) the prompt tokens the provider evaluated; then the ratios (b)/(a) and (a)/(c) for turn 1 and
for turns 2..T summed, and the median of the per-request ratios on turns 2..T.  The decoders run
one thread on the first CPU, the provider one thread on the second (when there is one).
``--cache-ram 0`` turns llama-server's host-memory prompt cache off on every child, so that the
slot affinity is shown on its own.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import attrs
import httpx
import trio

from bench import plot
from bench.rig import Noise, machine, open_direct, writes_settled
from bench.workloads import QUESTIONS, TOPICS, chat_turn
from supervisor import config as configuration
from supervisor.config import Config
from supervisor.daemon import Daemon
from supervisor.observe.logs import ROUTE_LOGGER
from supervisor.testing import RouteLines, run_daemon, unix_transport

ROOT = Path(__file__).resolve().parent.parent

TIMEOUT_S = 600


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chats", type=int, default=3, help="conversations, interleaved (3)")
    parser.add_argument("--turns", type=int, default=6, help="turns per conversation (6)")
    parser.add_argument("--system-words", type=int, default=440, help="words of system prompt (~600 tokens)")
    parser.add_argument("--max-tokens", type=int, default=16, help="reply tokens per turn (16)")
    parser.add_argument("--parallel", type=int, default=2, help="decoder slots (2)")
    parser.add_argument("--cache-ram", type=int, default=None, metavar="MIB", help="llama-server --cache-ram")
    parser.add_argument("--aa", action="store_true", help="A/A: (b) is a second plain onebitd, not the hybrid one")
    parser.add_argument("--quick", action="store_true", help="2 chats of 3 turns, short prompts: it runs")


def system_prompt(topic: str, words: int) -> str:
    facts = [f"Fact {i} about {topic}: it matters in way number {i * 7 % 31} for reason {i % 5}." for i in range(400)]
    text = f"You are a friendly expert on {topic}. Answer briefly. Here is your reference sheet. "
    return " ".join((text + " ".join(facts)).split()[:words])


def side_config(runtime_dir: Path, args: argparse.Namespace, *, hybrid: bool) -> Config:
    cpus = sorted(os.sched_getaffinity(0))
    decoder_cpus, provider_cpus = ([cpus[0]], [cpus[1]]) if len(cpus) >= 2 else (cpus, cpus)
    extra = ["--cache-ram", str(args.cache_ram)] if args.cache_ram is not None else []
    data = configuration.unstructure(Config())
    data["server"].update(port=0, runtime_dir=str(runtime_dir), shutdown_grace_s=10.0)
    data["cache"]["dir"] = str(runtime_dir / "prefix")  # never the user's own store
    data["model"].update(parallel=args.parallel, ctx_size=4096 * args.parallel)
    data["decoder"].update(threads=1, cpu_affinity=decoder_cpus, extra_args=extra)
    data["hybrid"].update(enabled=hybrid, min_prompt_tokens=64)
    if hybrid:
        data["provider"] = [
            {"kind": "llama-server", "name": "bench", "threads": 1, "cpu_affinity": provider_cpus, "extra_args": extra}
        ]
    config = configuration.structure(data, "bench")
    configuration.check(config, "bench")
    return config


@attrs.frozen
class Sample:
    ttft_ms: float
    decoder_n: int
    provider_n: int | None
    route: str


@attrs.define
class Side:
    """One side of the run: where its requests go, its own copy of every chat, what it measured."""

    name: str
    client: httpx.AsyncClient
    daemon: Daemon | None  # None: the direct llama-server (no route line, no store)
    chats: list[list[dict[str, str]]]
    samples: list[list[Sample]] = attrs.Factory(list)  # samples[turn][chat]


@asynccontextmanager
async def open_daemon(config: Config) -> AsyncIterator[tuple[Daemon, httpx.AsyncClient]]:
    # httpx's own pool limits for the front, as before the harness.
    async with (
        run_daemon(config, providers_ready=True, ready_timeout_s=TIMEOUT_S) as running,
        running.clients(request_timeout_s=TIMEOUT_S, max_connections=100, keepalive=20) as clients,
    ):
        yield running.daemon, clients.front


def order(sides: list[Side], request: int) -> list[Side]:
    """Request ``request``'s order: rotated by one each request, reversed every other cycle, so that
    over 2 x len(sides) requests each side goes first, in the middle and last alike, and after each
    other side alike."""
    shift = request % len(sides)
    rotated = sides[shift:] + sides[:shift]
    return rotated[::-1] if (request // len(sides)) % 2 else rotated


async def measure(side: Side, messages: list[dict[str, str]], args: argparse.Namespace, lines: RouteLines) -> Sample:
    """One request on ``side``; on an onebitd side, its route line and the store's write awaited."""
    before = len(lines.lines)
    ttft, reply, prompt_n = await chat_turn(side.client, messages, args.max_tokens)
    messages.append({"role": "assistant", "content": reply})
    if side.daemon is None:
        return Sample(ttft, prompt_n, None, "direct")
    with trio.fail_after(120):  # the route line comes once the request is done, after the last byte
        line = await lines.wait(before + 1)
        await writes_settled(side.daemon)
    return Sample(ttft, prompt_n, line.get("provider_prompt_n"), str(line.get("route", "?")))


async def measure_all(args: argparse.Namespace, sides: list[Side], lines: RouteLines) -> None:
    for side in sides:  # warm-up, unmeasured: a short chat of its own on each side
        await measure(side, [{"role": "user", "content": f"Warm-up for {side.name}: say hello."}], args, lines)
    request = 0
    for t in range(args.turns):
        rows: dict[str, list[Sample]] = {side.name: [] for side in sides}
        for c in range(args.chats):
            for side in order(sides, request):
                chat = side.chats[c]
                chat.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
                rows[side.name].append(await measure(side, chat, args, lines))
            request += 1
        for side in sides:
            side.samples.append(rows[side.name])
        print(f"  turn {t + 1} done", file=sys.stderr, flush=True)


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.chats, args.turns, args.system_words = 2, 3, 120
    b_name = "(b) plain, A/A" if args.aa else "(b) hybrid"
    print(
        f"onebit multiturn: {args.chats} chats x {args.turns} turns, interleaved, ~{args.system_words} words of "
        f"system prompt each, {args.max_tokens} reply tokens, parallel {args.parallel}, "
        f"cache-ram {args.cache_ram if args.cache_ram is not None else 'llama-server default'}; "
        "the sides up at once, request by request in rotating order"
        + ("; A/A: (b) is a second plain onebitd" if args.aa else "")
    )
    print(machine())
    noise = Noise.start([])  # this process's tree: onebitd and every llama-server
    topics = [TOPICS[i % len(TOPICS)] + ("" if i < len(TOPICS) else f" {i}") for i in range(args.chats)]

    def chats() -> list[list[dict[str, str]]]:
        return [[{"role": "system", "content": system_prompt(topic, args.system_words)}] for topic in topics]

    root = Path(tempfile.mkdtemp(prefix="ob-bench-", dir="/tmp"))
    lines = RouteLines()
    logger = logging.getLogger(ROUTE_LOGGER)
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        plain = side_config(root / "a", args, hybrid=False)
        other = side_config(root / "b", args, hybrid=not args.aa)
        with trio.fail_after(TIMEOUT_S * 4):
            async with AsyncExitStack() as stack:
                a_daemon, a_front = await stack.enter_async_context(open_daemon(plain))
                b_daemon, b_front = await stack.enter_async_context(open_daemon(other))
                (root / "c").mkdir(mode=0o700)
                socket = await stack.enter_async_context(open_direct(a_daemon, plain, root / "c"))
                direct = await stack.enter_async_context(
                    httpx.AsyncClient(transport=unix_transport(socket), base_url="http://direct", timeout=TIMEOUT_S)
                )
                sides = [
                    Side("(a) plain", a_front, a_daemon, chats()),
                    Side(b_name, b_front, b_daemon, chats()),
                    Side("(c) direct", direct, None, chats()),
                ]
                await measure_all(args, sides, lines)
    finally:
        logger.removeHandler(lines)
        shutil.rmtree(root, ignore_errors=True)
    report(args, {side.name: side.samples for side in sides}, b_name)
    print(noise.report([]))
    if args.plot:
        plot.write(
            args.plot,
            "scripts/bench multiturn",
            multiturn_figures({s.name: s.samples for s in sides}, b_name),
            quick=args.quick,
        )
    return 0


def report(args: argparse.Namespace, sides: dict[str, list[list[Sample]]], b_name: str) -> None:
    print()
    width = {name: max(20, len(name) + 10) for name in sides}
    header = "turn  " + "".join(f"{name + ' ttft ms':>{width[name]}}{'dec n':>7}" for name in sides)
    print(header + f"{'(b) prov n':>11}  routes (b)")
    for t in range(args.turns):
        cells = ""
        for name, samples in sides.items():
            row = samples[t]
            cells += f"{med([s.ttft_ms for s in row]):>{width[name]}.1f}{med([float(s.decoder_n) for s in row]):>7.0f}"
        b_row = sides[b_name][t]
        provider_ns = [float(s.provider_n) for s in b_row if s.provider_n is not None]
        routes = ",".join(s.route for s in b_row)
        print(f"{t + 1:<6}{cells}{med(provider_ns) if provider_ns else float('nan'):>11.0f}  {routes}")

    def total(name: str, turns: range) -> float:
        return sum(s.ttft_ms for t in turns for s in sides[name][t])

    def ratios(top: str, bottom: str, turns: range) -> list[float]:
        return [x.ttft_ms / y.ttft_ms for t in turns for x, y in zip(sides[top][t], sides[bottom][t], strict=True)]

    a, b, c = "(a) plain", b_name, "(c) direct"
    first, later = range(1), range(1, args.turns)
    a1, b1, c1 = total(a, first), total(b, first), total(c, first)
    a2, b2, c2 = total(a, later), total(b, later), total(c, later)
    print()
    print(f"turn 1, summed first-token time:     (b)/(a) {b1 / a1:.3f} (aim <= 1.05)   (a)/(c) {a1 / c1:.3f}")
    print(
        f"turns 2..{args.turns}, summed first-token time: (b)/(a) {b2 / a2:.3f} (aim <= 1.05)   (a)/(c) {a2 / c2:.3f}"
    )
    ba, ac = ratios(b, a, later), ratios(a, c, later)
    print(
        f"turns 2..{args.turns}, median of {len(ba)} request ratios: (b)/(a) {med(ba):.3f} "
        f"({min(ba):.2f} to {max(ba):.2f})   (a)/(c) {med(ac):.3f} ({min(ac):.2f} to {max(ac):.2f})"
    )
    print(f"(a)/(c), all turns: {(a1 + a2) / (c1 + c2):.3f} (aim <= 1.02)")


def multiturn_figures(sides: dict[str, list[list[Sample]]], b_name: str) -> list[plot.Panel]:
    """Per turn, each chat's first token on each side, and the prompt tokens each child evaluated."""
    evaluated = {
        f"{name}, decoder": [(t + 1, float(s.decoder_n)) for t, row in enumerate(samples) for s in row]
        for name, samples in sides.items()
    }
    evaluated[f"{b_name}, provider"] = [
        (t + 1, float(s.provider_n)) for t, row in enumerate(sides[b_name]) for s in row if s.provider_n is not None
    ]
    return [
        plot.XY(
            "first token per turn, each chat",
            "turn",
            "first token, ms",
            {
                name: [(t + 1, s.ttft_ms) for t, row in enumerate(samples) for s in row]
                for name, samples in sides.items()
            },
            integer_x=True,
        ),
        plot.XY("prompt tokens evaluated per turn", "turn", "tokens", evaluated, integer_x=True),
    ]
