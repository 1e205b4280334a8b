"""``scripts/bench multiturn``: chats that re-send their whole conversation every turn.

N chats (default 3) of T turns (default 6), interleaved turn by turn, each with its own ~600-token
system prompt, streamed, through three sides measured in the same run, one after another, each on a
freshly started onebitd (so every side starts cold):

    (a) onebitd with hybrid off (the plain route)
    (b) onebitd with the default hybrid config (a llama-server provider, the file route, the cost
        decision)
    (c) the decoder's llama-server reached directly over its socket (the same process flags; it
        picks its own slots by prompt similarity)

Per turn: time to first token (median over the chats), the prompt tokens the decoder evaluated, and
on (b) the prompt tokens the provider evaluated; then the ratios (b)/(a) and (a)/(c) for turn 1 and
for turns 2..T summed.  The decoder runs one thread on the first CPU, the provider one thread on the
second (when there is one).  ``--cache-ram 0`` turns llama-server's host-memory prompt cache off on
both children, so that the slot affinity is shown on its own.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_plot  # noqa: E402

from supervisor import config as configuration  # noqa: E402
from supervisor.config import Config  # noqa: E402
from supervisor.daemon import Daemon  # noqa: E402
from supervisor.observe.logs import ROUTE_LOGGER  # noqa: E402
from supervisor.testing import RouteLines, run_daemon  # noqa: E402

TIMEOUT_S = 600
TOPICS = ("lighthouses", "sourdough bread", "glaciers", "violins", "honeybees", "volcanoes")
QUESTIONS = (
    "Introduce yourself in one sentence.",
    "What is the most surprising fact you know?",
    "Explain it to a child.",
    "What would you ask an expert?",
    "Give me one practical tip.",
    "Summarise our chat in one line.",
    "Say goodbye.",
)


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chats", type=int, default=3, help="conversations, interleaved (3)")
    parser.add_argument("--turns", type=int, default=6, help="turns per conversation (6)")
    parser.add_argument("--system-words", type=int, default=440, help="words of system prompt (~600 tokens)")
    parser.add_argument("--max-tokens", type=int, default=16, help="reply tokens per turn (16)")
    parser.add_argument("--parallel", type=int, default=2, help="decoder slots (2)")
    parser.add_argument("--cache-ram", type=int, default=None, metavar="MIB", help="llama-server --cache-ram")
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


@asynccontextmanager
async def open_side(config: Config) -> AsyncIterator[tuple[Daemon, httpx.AsyncClient, httpx.AsyncClient]]:
    # httpx's own pool limits for the front, as before the harness.
    async with (
        run_daemon(config, providers_ready=True, ready_timeout_s=TIMEOUT_S) as running,
        running.clients(request_timeout_s=TIMEOUT_S, max_connections=100, keepalive=20) as clients,
    ):
        yield running.daemon, clients.front, clients.direct


async def turn(client: httpx.AsyncClient, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str, int]:
    """Streams one turn: time to the first token, the reply, the decoder's prompt_n."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first: float | None = None
    text, prompt_n = "", -1
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{client.base_url} answered {reply.status_code}: {(await reply.aread())[:300]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            for choice in data.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text += piece
            prompt_n = data.get("timings", {}).get("prompt_n", prompt_n)
    return ((first or time.perf_counter()) - start) * 1000, text, prompt_n


async def run_side(args: argparse.Namespace, name: str, hybrid: bool, direct: bool) -> list[list[Sample]]:
    """samples[turn][chat]"""
    runtime_dir = Path(tempfile.mkdtemp(prefix="ob-bench-", dir="/tmp"))
    lines = RouteLines()
    logging.getLogger(ROUTE_LOGGER).addHandler(lines)
    logging.getLogger(ROUTE_LOGGER).setLevel(logging.INFO)
    try:
        async with open_side(side_config(runtime_dir, args, hybrid=hybrid)) as (_daemon, front, decoder):
            client = decoder if direct else front
            topics = [TOPICS[i % len(TOPICS)] + ("" if i < len(TOPICS) else f" {i}") for i in range(args.chats)]
            chats = [[{"role": "system", "content": system_prompt(t, args.system_words)}] for t in topics]
            samples: list[list[Sample]] = []
            for t in range(args.turns):
                row = []
                for chat in chats:
                    chat.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
                    before = len(lines.lines)
                    ttft, reply, prompt_n = await turn(client, chat, args.max_tokens)
                    chat.append({"role": "assistant", "content": reply})
                    if not direct:  # the route line comes once the request is done, after the last byte
                        with trio.fail_after(60):
                            await lines.wait(before + 1)
                    line = lines.lines[before] if len(lines.lines) > before else {}
                    row.append(Sample(ttft, prompt_n, line.get("provider_prompt_n"), line.get("route", "direct")))
                samples.append(row)
                print(f"  {name}: turn {t + 1} done", file=sys.stderr, flush=True)
            return samples
    finally:
        logging.getLogger(ROUTE_LOGGER).removeHandler(lines)
        shutil.rmtree(runtime_dir, ignore_errors=True)


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.chats, args.turns, args.system_words = 2, 3, 120
    print(
        f"onebit multiturn: {args.chats} chats x {args.turns} turns, interleaved, ~{args.system_words} words of "
        f"system prompt each, {args.max_tokens} reply tokens, parallel {args.parallel}, "
        f"cache-ram {args.cache_ram if args.cache_ram is not None else 'llama-server default'}"
    )
    sides = {
        "(c) direct": await run_side(args, "(c) direct", hybrid=False, direct=True),
        "(a) plain": await run_side(args, "(a) plain", hybrid=False, direct=False),
        "(b) hybrid": await run_side(args, "(b) hybrid", hybrid=True, direct=False),
    }
    print()
    header = (
        "turn  " + "".join(f"{name + ' ttft ms':>20}{'dec n':>7}" for name in sides) + f"{'(b) prov n':>11}  routes (b)"
    )
    print(header)
    for t in range(args.turns):
        cells = ""
        for samples in sides.values():
            row = samples[t]
            cells += f"{med([s.ttft_ms for s in row]):>20.1f}{med([float(s.decoder_n) for s in row]):>7.0f}"
        hybrid_row = sides["(b) hybrid"][t]
        provider_ns = [float(s.provider_n) for s in hybrid_row if s.provider_n is not None]
        routes = ",".join(s.route for s in hybrid_row)
        print(f"{t + 1:<6}{cells}{med(provider_ns) if provider_ns else float('nan'):>11.0f}  {routes}")

    def total(name: str, turns: range) -> float:
        return sum(s.ttft_ms for t in turns for s in sides[name][t])

    first, later = range(1), range(1, args.turns)
    a1, b1, c1 = total("(a) plain", first), total("(b) hybrid", first), total("(c) direct", first)
    a2, b2, c2 = total("(a) plain", later), total("(b) hybrid", later), total("(c) direct", later)
    print()
    print(f"turn 1, summed first-token time:     (b)/(a) {b1 / a1:.3f} (aim <= 1.05)   (a)/(c) {a1 / c1:.3f}")
    print(
        f"turns 2..{args.turns}, summed first-token time: (b)/(a) {b2 / a2:.3f} (aim <= 1.05)   (a)/(c) {a2 / c2:.3f}"
    )
    print(f"(a)/(c), all turns: {(a1 + a2) / (c1 + c2):.3f} (aim <= 1.02)")
    if args.plot:
        bench_plot.write(args.plot, "scripts/bench multiturn", multiturn_figures(sides), quick=args.quick)
    return 0


def multiturn_figures(sides: dict[str, list[list[Sample]]]) -> list[bench_plot.Panel]:
    """Per turn, each chat's first token on each side, and the prompt tokens each child evaluated."""
    evaluated = {
        f"{name}, decoder": [(t + 1, float(s.decoder_n)) for t, row in enumerate(samples) for s in row]
        for name, samples in sides.items()
    }
    evaluated["(b) hybrid, provider"] = [
        (t + 1, float(s.provider_n))
        for t, row in enumerate(sides["(b) hybrid"])
        for s in row
        if s.provider_n is not None
    ]
    return [
        bench_plot.XY(
            "first token per turn, each chat",
            "turn",
            "first token, ms",
            {
                name: [(t + 1, s.ttft_ms) for t, row in enumerate(samples) for s in row]
                for name, samples in sides.items()
            },
            integer_x=True,
        ),
        bench_plot.XY("prompt tokens evaluated per turn", "turn", "tokens", evaluated, integer_x=True),
    ]
