"""``scripts/bench prefix``: a long shared system prompt, decoder crashes, and the prefix store.

Two onebitd side by side, both up for the whole run: (a) with the prefix store, (b) without it
(``cache.enabled = false``); ``--aa`` gives (b) the store as well, an A/A run that shows what the
method itself favours.  llama-server's own host-memory prompt cache is off on both
(``cache.ram_mib = 0``): it does not survive a crash either, and would only blur the warm figures.
Requests share a ~1,500-token system prompt, each with its own short question, the same questions on
both sides; each request is asked on both sides, the order alternating (ABBA).  First a cold request
each, then ``--before`` warm ones; then ``--crashes`` times: both decoders ``kill -9``ed at once, and
once both are back, ``--after`` more requests each, the first of them the first after the crash.

Printed: the cold first token, the median and spread of the warm ones, of the first after each
crash and of the rest after the crashes; the ratios (b)/(a) of the first after the crash (aim: at
least 5x) and, on (a), first-after-crash against warm (aim: at most 2x); the machine line and the
other processes' CPU during the run.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from bench import plot
from bench.rig import Noise, machine
from supervisor import config as configuration
from supervisor.config import Config
from supervisor.supervise.child import ChildState
from supervisor.testing import run_daemon

ROOT = Path(__file__).resolve().parent.parent

TIMEOUT_S = 900


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--before", type=int, default=10, help="warm requests a side before the first crash (10)")
    parser.add_argument("--crashes", type=int, default=6, help="decoder crashes, each side's at once (6)")
    parser.add_argument("--after", type=int, default=2, help="requests a side after each crash (2)")
    parser.add_argument("--system-words", type=int, default=1100, help="words of system prompt (~1,500 tokens)")
    parser.add_argument("--aa", action="store_true", help="A/A: the store on both sides")
    parser.add_argument("--quick", action="store_true", help="2 warm requests, 1 crash, a ~300-token prompt: it runs")


def system_prompt(words: int) -> str:
    facts = [
        f"Rule {i}: parcel {i} goes to shelf {i * 13 % 97}, row {i % 7}, unless it is fragile." for i in range(900)
    ]
    return " ".join(("You are a warehouse assistant. The rules follow. " + " ".join(facts)).split()[:words])


def side_config(runtime_dir: Path, *, store: bool) -> Config:
    data = configuration.unstructure(Config())
    data["server"].update(port=0, runtime_dir=str(runtime_dir), shutdown_grace_s=10.0)
    data["cache"].update(enabled=store, dir=str(runtime_dir / "prefix"), ram_mib=0, min_tokens=256)
    data["model"].update(parallel=2, ctx_size=8192)
    # Crashes are what is measured: none may mark the decoder failed, nor wait out a long backoff.
    data["decoder"]["restart"] = {"max_failures": 1000, "backoff_initial_s": 0.1, "backoff_max_s": 0.5}
    data["hybrid"]["enabled"] = False  # the store against the decoder's own prefill, nothing else
    data["provider"] = []
    config = configuration.structure(data, "bench")
    configuration.check(config, "bench")
    return config


async def first_token_ms(client: httpx.AsyncClient, system: str, question: str) -> float:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    body: dict[str, Any] = {"messages": messages, "max_tokens": 4, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first: float | None = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"onebitd answered {reply.status_code}: {(await reply.aread())[:300]!r}")
        # Read to the end: a client that hangs up after its first token is a cancelled request, and
        # onebitd keeps no prefix of those.
        async for line in reply.aiter_lines():
            if first is None and line.startswith("data: ") and '"content"' in line:
                first = time.perf_counter()
    if first is None:
        raise RuntimeError("no token came")
    return (first - start) * 1000


SIDES = ("(a) store", "(b) no store")


async def crash(daemon: Any) -> None:
    """``kill -9`` the decoder; back when its next generation is ready."""
    decoder = daemon.models.default.decoder
    pid, generation = decoder.pid, decoder.generation
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    while not (decoder.generation > generation and decoder.state is ChildState.READY):
        await decoder.wait_state(*(s for s in ChildState if s is not decoder.state))


async def settled(daemon: Any) -> None:
    """The store's writes run off the requests' path: wait until its first prefix is written."""
    store = daemon.models.default.store
    if store is not None:
        with trio.fail_after(120):
            while store.statistics().stores < 1:  # noqa: ASYNC110
                await trio.sleep(0.05)


async def measure(args: argparse.Namespace, runtime: Path) -> dict[str, dict[str, Any]]:
    system = system_prompt(args.system_words)
    sides: dict[str, dict[str, Any]] = {name: {"cold": [], "warm": [], "first": [], "after": []} for name in SIDES}
    async with (
        run_daemon(side_config(runtime / "a", store=True), ready_timeout_s=TIMEOUT_S) as a,
        run_daemon(side_config(runtime / "b", store=args.aa), ready_timeout_s=TIMEOUT_S) as b,
        httpx.AsyncClient(base_url=a.url, timeout=TIMEOUT_S) as client_a,
        httpx.AsyncClient(base_url=b.url, timeout=TIMEOUT_S) as client_b,
    ):
        running = dict(zip(SIDES, (a, b), strict=True))
        clients = dict(zip(SIDES, (client_a, client_b), strict=True))
        count = 0

        async def ask(cell: str) -> None:
            """One question on both sides, the order alternating from one question to the next."""
            nonlocal count
            question = f"Question {count}: where does parcel {count * 3} go?"
            for name in SIDES if count % 2 == 0 else SIDES[::-1]:
                sides[name][cell].append(await first_token_ms(clients[name], system, question))
            count += 1

        with trio.fail_after(TIMEOUT_S * (args.crashes + 1)):
            await ask("cold")
            for _ in range(args.before):
                await ask("warm")
            for _ in range(args.crashes):
                for name in SIDES:
                    await settled(running[name].daemon)
                async with trio.open_nursery() as nursery:
                    for name in SIDES:
                        nursery.start_soon(crash, running[name].daemon)
                await ask("first")
                for _ in range(args.after - 1):
                    await ask("after")
        for name in SIDES:
            sides[name]["entries"] = running[name].daemon.models.default.store_statistics().entries
    return sides


def cell(values: list[float]) -> str:
    if not values:
        return f"{'-':>9}{'':>14}"
    return f"{statistics.median(values):>9.0f}{f'{min(values):.0f}-{max(values):.0f}':>14}"


async def run(args: argparse.Namespace) -> int:

    if args.quick:
        args.before, args.crashes, args.after, args.system_words = 2, 1, 2, 220
    print(f"machine: {machine()}")
    print(
        f"onebit prefix: a ~{args.system_words}-word system prompt shared by every request; a cold request, "
        f"{args.before} warm, then {args.crashes} x (kill -9 of both decoders, {args.after} more); "
        f"each request on both sides, the order alternating; (a) the store, (b) "
        + ("the store too (A/A)" if args.aa else "no store")
    )
    noise = Noise.start([])
    with tempfile.TemporaryDirectory(prefix="ob-bench-", dir="/tmp") as tmp:
        sides = await measure(args, Path(tmp))
    print()
    print("first token, ms: median and spread; first: the first request after a crash, later: the rest after it")
    print(
        f"{'side':<14}{'cold':>9}{'warm':>9}{'spread':>14}{'first':>9}{'spread':>14}"
        f"{'later':>9}{'spread':>14}{'entries':>9}"
    )
    for name, side in sides.items():
        label = "(b) store, A/A" if args.aa and name == SIDES[1] else name
        print(
            f"{label:<14}{side['cold'][0]:>9.0f}{cell(side['warm'])}{cell(side['first'])}{cell(side['after'])}"
            f"{side['entries']:>9}"
        )
    a, b = sides[SIDES[0]], sides[SIDES[1]]
    warm_a = statistics.median(a["warm"] or a["cold"])
    pairs = [y / x for x, y in zip(a["first"], b["first"], strict=True)]
    print()
    print(
        f"first after a crash, (b)/(a): {statistics.median(b['first']) / statistics.median(a['first']):.2f}x"
        f" of the medians; crash by crash {' '.join(f'{r:.2f}' for r in pairs)}   (aim: at least 5x)"
    )
    print(f"warm, (b)/(a): {statistics.median(b['warm'] or b['cold']) / warm_a:.2f}x")
    print(f"(a) first after a crash / warm median: {statistics.median(a['first']) / warm_a:.2f}x   (aim: at most 2x)")
    print(noise.report([]))
    if args.plot:
        plot.write(args.plot, "scripts/bench prefix", prefix_figures(sides), quick=args.quick)
    return 0


def prefix_figures(sides: dict[str, dict[str, Any]]) -> list[plot.Panel]:
    """Every request's first token in order, the crashes marked; and the table's figures as bars."""
    requests: dict[str, list[tuple[float, float]]] = {}
    marks: list[tuple[float, str]] = []
    for name, side in sides.items():
        order = [*side["cold"], *side["warm"]]
        after = len(side["after"]) // max(1, len(side["first"]))
        later = iter(side["after"])
        for i, first in enumerate(side["first"]):
            if name == SIDES[0]:
                marks.append((len(order) + 0.5, "decoder kill -9" if i == 0 else ""))
            order += [first, *(next(later) for _ in range(after))]
        requests[name] = [(i + 1, ms) for i, ms in enumerate(order)]
    table = {
        "cold (the first)": {name: side["cold"] for name, side in sides.items()},
        "warm": {name: side["warm"] for name, side in sides.items()},
        "first after the crash": {name: side["first"] for name, side in sides.items()},
        "later after the crash": {name: side["after"] for name, side in sides.items()},
    }
    return [
        plot.XY(
            "first token, request by request",
            "request",
            "first token, ms",
            requests,
            marks=marks,
            integer_x=True,
            log_y=True,
        ),
        plot.Bars("first token: cold, warm, after the crashes", "ms", table, log_y=True),
    ]
