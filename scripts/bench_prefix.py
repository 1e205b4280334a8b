"""``scripts/bench prefix``: a long shared system prompt, a decoder crash, and the prefix store.

20 requests share a ~1,500-token system prompt, each with its own short question; then the decoder
is ``kill -9``ed and 5 more requests follow once it is back.  Run twice, one after the other, on a
freshly started onebitd each: (a) with the prefix store, (b) without it (``cache.enabled = false``).
llama-server's own host-memory prompt cache is off on both (``cache.ram_mib = 0``): it does not
survive a crash either, and would only blur the warm figures.

Printed: time to first token of the first request (cold), the median of the warm ones before the
crash, the first request after the crash, and the median after it; the ratios (b)/(a) after the
crash (aim: at least 5x) and, on (a), first-after-crash against warm (aim: at most 2x).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_plot  # noqa: E402

from supervisor import config as configuration  # noqa: E402
from supervisor.config import Config  # noqa: E402
from supervisor.supervise.child import ChildState  # noqa: E402
from supervisor.testing import run_daemon  # noqa: E402

TIMEOUT_S = 900


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--before", type=int, default=20, help="requests before the crash (20)")
    parser.add_argument("--after", type=int, default=5, help="requests after the crash (5)")
    parser.add_argument("--system-words", type=int, default=1100, help="words of system prompt (~1,500 tokens)")
    parser.add_argument("--quick", action="store_true", help="4 + 2 requests, a ~300-token prompt: it runs")


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


async def run_side(args: argparse.Namespace, *, store: bool) -> dict[str, Any]:
    runtime_dir = Path(tempfile.mkdtemp(prefix="ob-bench-", dir="/tmp"))
    system = system_prompt(args.system_words)
    try:
        async with run_daemon(side_config(runtime_dir, store=store), ready_timeout_s=TIMEOUT_S) as running:
            daemon = running.daemon
            with trio.fail_after(TIMEOUT_S):
                async with httpx.AsyncClient(base_url=running.url, timeout=TIMEOUT_S) as client:
                    before = [
                        await first_token_ms(client, system, f"Question {i}: where does parcel {i * 3} go?")
                        for i in range(args.before)
                    ]
                    if store:  # the store's writes run off the requests' path: let them land
                        with trio.fail_after(120):
                            while daemon.models.default.store.statistics().stores < 2:  # noqa: ASYNC110
                                await trio.sleep(0.05)
                    decoder = daemon.models.default.decoder
                    pid, generation = decoder.pid, decoder.generation
                    assert pid is not None
                    os.kill(pid, signal.SIGKILL)
                    while not (decoder.generation > generation and decoder.state is ChildState.READY):
                        await decoder.wait_state(*(s for s in ChildState if s is not decoder.state))
                    after = [
                        await first_token_ms(client, system, f"Question {i}: where does parcel {i * 5} go?")
                        for i in range(args.before, args.before + args.after)
                    ]
                entries = daemon.models.default.store.statistics().entries
        return {"before": before, "after": after, "entries": entries}
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


async def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.before, args.after, args.system_words = 4, 2, 220
    print(
        f"onebit prefix: {args.before} requests sharing a ~{args.system_words}-word system prompt, kill -9 of the "
        f"decoder, {args.after} more; with the prefix store (a) and without (b)"
    )
    sides = {"(a) store": await run_side(args, store=True), "(b) no store": await run_side(args, store=False)}
    print()
    print(f"{'side':<14}{'cold ms':>10}{'warm median':>13}{'1st after':>11}{'after median':>14}{'entries':>9}")
    for name, side in sides.items():
        warm = statistics.median(side["before"][1:]) if len(side["before"]) > 1 else float("nan")
        print(
            f"{name:<14}{side['before'][0]:>10.1f}{warm:>13.1f}{side['after'][0]:>11.1f}"
            f"{statistics.median(side['after']):>14.1f}{side['entries']:>9}"
        )
    a, b = sides["(a) store"], sides["(b) no store"]
    warm_a = statistics.median(a["before"][1:]) if len(a["before"]) > 1 else a["before"][0]
    print()
    print(f"first after the crash, (b)/(a): {b['after'][0] / a['after'][0]:.2f}x   (aim: at least 5x)")
    print(f"median after the crash, (b)/(a): {statistics.median(b['after']) / statistics.median(a['after']):.2f}x")
    print(f"(a) first after the crash / warm median: {a['after'][0] / warm_a:.2f}x   (aim: at most 2x)")
    if args.plot:
        bench_plot.write(args.plot, "scripts/bench prefix", prefix_figures(sides), quick=args.quick)
    return 0


def prefix_figures(sides: dict[str, dict[str, Any]]) -> list[bench_plot.Panel]:
    """Every request's first token in order, the crash marked; and the table's four figures as bars."""
    before = len(next(iter(sides.values()))["before"])
    requests = {
        name: [(i + 1, ms) for i, ms in enumerate(side["before"] + side["after"])] for name, side in sides.items()
    }
    table = {
        "cold (the first)": {name: side["before"][:1] for name, side in sides.items()},
        "warm": {name: side["before"][1:] for name, side in sides.items()},
        "first after the crash": {name: side["after"][:1] for name, side in sides.items()},
        "after the crash": {name: side["after"] for name, side in sides.items()},
    }
    return [
        bench_plot.XY(
            "first token, request by request",
            "request",
            "first token, ms",
            requests,
            marks=[(before + 0.5, "decoder kill -9")],
            integer_x=True,
            log_y=True,
        ),
        bench_plot.Bars("first token: cold, warm, after the crash", "ms", table, log_y=True),
    ]
