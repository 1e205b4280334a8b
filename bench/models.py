"""``scripts/bench models``: two models through a one-model budget, swapped without losing prompts.

The shipped GGUF is served under two names with another ``ctx_size`` each ("alpha", "beta"), with
``models.max_loaded = 1``: every switch between them is a swap (one decoder stopped, the other
started).  Conversations alternate between the models, a round at a time: on each model, its
conversation's next turn right after the model was swapped back in ("swap-back"), then another turn
at once, the model still loaded ("warm").  Two onebitd side by side, both up for the whole run: (a)
with the prefix store, (b) without it (``cache.enabled = false``: what a peer that forgets its prompt
cache on a swap gives); ``--aa`` gives (b) the store too, an A/A run.  Each turn is asked on both
sides (the same conversation, the same words), the order alternating turn by turn (ABBA); the
conversations' first round is cold and unmeasured.  llama-server's own in-memory cache is off on both.

Then a burst: requests for both models at once, in mixed order; counted, the swaps per model per
burst.  Every request must answer 200 (or a clean 503 with Retry-After); no child, socket or state
file may be left once the daemon stopped.

Printed: time to first token of each swap-back turn beside its ``load_ms`` (the time it waited for
its model to load, which no cache can save), the warm turns' median, the ratios swap-back / warm
(aim: at most 2x; also without load_ms) and (b) / (a) for swap-back turns (aim: at least 5x), and the
burst's swaps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from bench import plot
from bench.rig import Noise, machine
from supervisor import config as configuration
from supervisor.config import Config
from supervisor.daemon import Daemon
from supervisor.observe.logs import ROUTE_LOGGER
from supervisor.testing import RouteLines

ROOT = Path(__file__).resolve().parent.parent

TIMEOUT_S = 900
MODELS = ("alpha", "beta")


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=4, help="rounds of swap-back and warm turns per model (4)")
    parser.add_argument("--words", type=int, default=700, help="words of each conversation's document (~1,000 tokens)")
    parser.add_argument("--burst", type=int, default=8, help="requests in the burst, both models mixed (8)")
    parser.add_argument("--aa", action="store_true", help="A/A: the store on both sides")
    parser.add_argument("--quick", action="store_true", help="2 rounds, a ~300-token document, a burst of 4: it runs")


def side_config(runtime_dir: Path, *, store: bool) -> Config:
    data = configuration.unstructure(Config())
    data["server"].update(port=0, runtime_dir=str(runtime_dir), shutdown_grace_s=10.0)
    data["cache"].update(enabled=store, dir=str(runtime_dir / "prefix"), ram_mib=0, min_tokens=256)
    data["model"] = [
        {"name": "alpha", "ctx_size": 4096, "parallel": 2},
        {"name": "beta", "ctx_size": 2048, "parallel": 1},
    ]
    data["models"] = {"max_loaded": 1}
    data["hybrid"]["enabled"] = False  # the store against the decoder's own prefill, nothing else
    data["provider"] = []
    config = configuration.structure(data, "bench")
    configuration.check(config, "bench")
    return config


def document(words: int, seed: int) -> str:
    facts = [f"Fact {i}: box {i * seed % 89} holds item {i * 7 % 101} in colour {i % 5}." for i in range(2000)]
    return " ".join(" ".join(facts).split()[:words])


async def turn(client: httpx.AsyncClient, model: str, messages: list[dict[str, str]]) -> tuple[float, str]:
    """One streamed chat turn: its time to first token (ms) and its reply."""
    body = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first: float | None = None
    text = ""
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"onebitd answered {reply.status_code}: {(await reply.aread())[:300]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    first = first or time.perf_counter()
                    text += content
    if first is None:
        raise RuntimeError("no token came")
    return (first - start) * 1000, text


async def burst(client: httpx.AsyncClient, daemon: Daemon, n: int) -> dict[str, Any]:
    """``n`` requests at once, alternating models: statuses and the loads each model took."""
    loads = {name: model.loads for name in MODELS if (model := daemon.models.get(name)) is not None}
    statuses: list[tuple[int, bool]] = []

    async def one(i: int) -> None:
        body = {"model": MODELS[i % 2], "prompt": f"Say the number {i}.", "n_predict": 8, "temperature": 0}
        reply = await client.post("/completion", json=body)
        statuses.append((reply.status_code, "retry-after" in reply.headers))

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    after = {name: model.loads for name in MODELS if (model := daemon.models.get(name)) is not None}
    return {"statuses": statuses, "loads": {name: after[name] - loads[name] for name in MODELS}}


def leftovers(runtime: Path, pids: list[int]) -> tuple[list[str], list[int]]:
    """The files a stopped onebitd left outside its prefix stores, and its children still there."""
    files = [p.relative_to(runtime) for p in runtime.rglob("*") if not p.is_dir()]
    return [str(f) for f in files if f.parts[0] != "prefix"], [pid for pid in pids if Path(f"/proc/{pid}").exists()]


SIDES = ("(a) store", "(b) no store")


@attrs.define
class Side:
    """One onebitd of the two, and what its turns measured."""

    daemon: Daemon
    client: httpx.AsyncClient
    chats: dict[str, list[dict[str, str]]]
    swapback: list[dict[str, float]] = attrs.Factory(list)
    warm: list[float] = attrs.Factory(list)
    cold: list[float] = attrs.Factory(list)  # each conversation's first turn: no cache has any of it

    async def turn(self, line_at: Any, name: str, question: str, kind: str, cold: bool) -> None:
        chat = self.chats[name]
        chat.append({"role": "user", "content": question})
        ms, text = await turn(self.client, name, chat)
        chat.append({"role": "assistant", "content": text})
        # Its route line comes once the slot was saved for the store: nothing of this turn is left
        # running when the other side's turn starts.
        line = await line_at()
        if cold:
            if kind == "swap-back":  # the conversation's very first turn
                self.cold.append(ms)
        elif kind == "warm":
            self.warm.append(ms)
        else:
            other = self.daemon.models.get(MODELS[1 - MODELS.index(name)])
            this = self.daemon.models.get(name)
            assert other is not None
            assert this is not None
            self.swapback.append(
                {
                    "ttft_ms": ms,
                    "load_ms": line.get("load_ms") or 0.0,
                    # Of that wait: the other model's unload, this one's load.
                    "unload": other.last_unload_ms or 0.0,
                    "decoder_load": this.last_load_ms or 0.0,
                    "restored": line.get("restored_tokens") or 0,
                    "prefilled": line.get("decoder_prompt_n") or 0,
                }
            )


@contextlib.asynccontextmanager
async def open_side(args: argparse.Namespace, runtime_dir: Path, *, store: bool) -> AsyncIterator[Side]:
    daemon = Daemon(side_config(runtime_dir, store=store))
    async with trio.open_nursery() as nursery:
        started = await nursery.start(daemon.run)
        try:
            async with httpx.AsyncClient(base_url=started.binds[0], timeout=TIMEOUT_S) as client:
                chats = {
                    name: [{"role": "system", "content": document(args.words, 3 + i)}] for i, name in enumerate(MODELS)
                }
                yield Side(daemon, client, chats)
        finally:
            daemon.request_stop()


async def run_sides(args: argparse.Namespace, runtime: Path) -> dict[str, dict[str, Any]]:
    lines = RouteLines()
    route_log = logging.getLogger(ROUTE_LOGGER)
    route_log.addHandler(lines)
    route_log.setLevel(logging.INFO)
    results: dict[str, dict[str, Any]] = {}
    seen = 0

    async def next_line() -> dict[str, Any]:
        """The route line of the turn just asked (one request at a time: they come in order)."""
        nonlocal seen
        seen += 1
        return await lines.wait(seen)

    try:
        async with (
            open_side(args, runtime / "a", store=True) as a,
            open_side(args, runtime / "b", store=args.aa) as b,
        ):
            with trio.fail_after(TIMEOUT_S):
                turns = 0
                for round_ in range(args.rounds):
                    for name in MODELS:
                        for kind in ("swap-back", "warm"):
                            question = f"Round {round_}, {kind}: which box?"
                            for side in (a, b) if turns % 2 == 0 else (b, a):
                                await side.turn(next_line, name, question, kind, cold=round_ == 0)
                            turns += 1
                for label, side in zip(SIDES, (a, b), strict=True):
                    results[label] = {
                        "swapback": side.swapback,
                        "warm": side.warm,
                        "cold": side.cold,
                        "burst": await burst(side.client, side.daemon, args.burst),
                        "pids": [child.pid for child in side.daemon.children() if child.pid is not None],
                        "swaps": side.daemon.models.swaps,
                    }
    finally:
        route_log.removeHandler(lines)
    for label, directory in zip(SIDES, ("a", "b"), strict=True):
        results[label]["left"], results[label]["alive"] = leftovers(runtime / directory, results[label]["pids"])
    return results


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.rounds, args.words, args.burst = 2, 200, 4
    print(
        f"onebit models: two models (alpha ctx 4096, beta ctx 2048) through max_loaded = 1, {args.rounds} rounds of "
        f"a swap-back and a warm turn each, ~{args.words}-word conversations; a burst of {args.burst}; each turn on "
        "both sides, the order alternating; (a) the prefix store, (b) " + ("the store too (A/A)" if args.aa else "none")
    )

    print(f"machine: {machine()}")
    noise = Noise.start([])
    with tempfile.TemporaryDirectory(prefix="ob-bench-", dir="/tmp") as tmp:
        sides = await run_sides(args, Path(tmp))
    ok = True
    for name, side in sides.items():
        label = "(b) store, A/A" if args.aa and name == SIDES[1] else name
        print(
            f"\n{label}: swap-back turns (time to first token; load_ms, the wait for the model's load: the other's"
            " unload, then this one's decoder start; tokens)"
        )
        heads = [("ttft ms", 10), ("load_ms", 10), ("(unload", 9), ("load)", 8), ("ttft-load", 11)]
        print("".join(f"{head:>{width}}" for head, width in [*heads, ("restored", 10), ("prefilled", 11)]))
        for s in side["swapback"]:
            print(
                f"{s['ttft_ms']:>10.1f}{s['load_ms']:>10.1f}{s['unload']:>9.0f}{s['decoder_load']:>8.0f}"
                f"{s['ttft_ms'] - s['load_ms']:>11.1f}{s['restored']:>10}{s['prefilled']:>11}"
            )
        warm = side["warm"]
        print(f"warm turns: median {_median(warm):.1f} ms over {len(warm)} ({min(warm):.0f}-{max(warm):.0f})")
        statuses = side["burst"]["statuses"]
        clean = all(code == 200 or (code == 503 and retry) for code, retry in statuses)
        loads = side["burst"]["loads"]
        print(
            f"burst: {len(statuses)} requests, statuses {sorted({code for code, _ in statuses})}, loads per model "
            f"{loads} (aim: at most 1 each); swaps in the run: {side['swaps']}"
        )
        print(f"left after the stop: files {side['left'] or 'none'}, children {side['alive'] or 'none'}")
        ok &= clean and not side["left"] and not side["alive"]
    a, b = sides["(a) store"], sides["(b) no store"]
    a_ttft = _median([s["ttft_ms"] for s in a["swapback"]])
    a_net = _median([s["ttft_ms"] - s["load_ms"] for s in a["swapback"]])
    b_ttft = _median([s["ttft_ms"] for s in b["swapback"]])
    b_net = _median([s["ttft_ms"] - s["load_ms"] for s in b["swapback"]])
    warm_a = _median(a["warm"])
    print()
    print(f"(a) swap-back / warm, medians: {a_ttft / warm_a:.2f}x; without load_ms {a_net / warm_a:.2f}x (aim: <= 2x)")
    print(f"swap-back (b) / (a), medians: {b_ttft / a_ttft:.2f}x; without load_ms {b_net / a_net:.2f}x (aim: >= 5x)")
    print(
        f"load_ms, median: (a) {_median([s['load_ms'] for s in a['swapback']]):.1f}, "
        f"(b) {_median([s['load_ms'] for s in b['swapback']]):.1f}"
    )
    pairs = [y["ttft_ms"] / x["ttft_ms"] for x, y in zip(a["swapback"], b["swapback"], strict=True)]
    print(f"swap-back (b) / (a), turn by turn: {' '.join(f'{r:.2f}' for r in pairs)}")
    print(noise.report([]))
    if args.plot:
        plot.write(args.plot, "scripts/bench models", model_figures(sides), quick=args.quick)
    return 0 if ok else 1


def model_figures(sides: dict[str, dict[str, Any]]) -> list[plot.Panel]:
    """Swap-back turns against warm and cold ones, with and without the store; the ratios."""
    turns = {
        "swap-back": {name: [s["ttft_ms"] for s in side["swapback"]] for name, side in sides.items()},
        "swap-back less load_ms": {
            name: [s["ttft_ms"] - s["load_ms"] for s in side["swapback"]] for name, side in sides.items()
        },
        "warm": {name: side["warm"] for name, side in sides.items()},
        "cold (first turn)": {name: side["cold"] for name, side in sides.items()},
    }
    a = sides["(a) store"]
    ratios = {
        "(a) swap-back / warm": {
            "ttft": [_median(turns["swap-back"]["(a) store"]) / _median(a["warm"])],
            "less load_ms": [_median(turns["swap-back less load_ms"]["(a) store"]) / _median(a["warm"])],
        },
        "swap-back, (b) / (a)": {
            "ttft": [_median(turns["swap-back"]["(b) no store"]) / _median(turns["swap-back"]["(a) store"])],
            "less load_ms": [
                _median(turns["swap-back less load_ms"]["(b) no store"])
                / _median(turns["swap-back less load_ms"]["(a) store"])
            ],
        },
    }
    return [
        plot.Bars("first token: swap-back against warm and cold", "ms", turns, log_y=True),
        plot.Bars("the ratios (medians)", "ratio", ratios, reference=1.0),
    ]
