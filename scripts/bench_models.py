"""``scripts/bench models``: two models through a one-model budget, swapped without losing prompts.

The shipped GGUF is served under two names with another ``ctx_size`` each ("alpha", "beta"), with
``models.max_loaded = 1``: every switch between them is a swap (one decoder stopped, the other
started).  Conversations alternate between the models, a round at a time: on each model, its
conversation's next turn right after the model was swapped back in ("swap-back"), then another turn
at once, the model still loaded ("warm").  Run twice, one after the other, on a freshly started
onebitd each: (a) with the prefix store, (b) without it (``cache.enabled = false``: what a peer that
forgets its prompt cache on a swap gives).  llama-server's own in-memory cache is off on both.

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
import json
import logging
import shutil
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
from supervisor.daemon import Daemon  # noqa: E402
from supervisor.observe.logs import ROUTE_LOGGER  # noqa: E402
from supervisor.testing import RouteLines  # noqa: E402

TIMEOUT_S = 900
MODELS = ("alpha", "beta")


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=4, help="rounds of swap-back and warm turns per model (4)")
    parser.add_argument("--words", type=int, default=700, help="words of each conversation's document (~1,000 tokens)")
    parser.add_argument("--burst", type=int, default=8, help="requests in the burst, both models mixed (8)")
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


async def run_side(args: argparse.Namespace, *, store: bool) -> dict[str, Any]:
    runtime_dir = Path(tempfile.mkdtemp(prefix="ob-bench-", dir="/tmp"))
    lines = RouteLines()
    route_log = logging.getLogger(ROUTE_LOGGER)
    route_log.addHandler(lines)
    route_log.setLevel(logging.INFO)
    swapback: list[dict[str, float]] = []
    warm: list[float] = []
    cold: list[float] = []  # each conversation's first turn: no cache has any of it
    try:
        daemon = Daemon(side_config(runtime_dir, store=store))
        async with trio.open_nursery() as nursery:
            started = await nursery.start(daemon.run)
            try:
                with trio.fail_after(TIMEOUT_S):
                    async with httpx.AsyncClient(base_url=started.binds[0], timeout=TIMEOUT_S) as client:
                        chats = {
                            name: [{"role": "system", "content": document(args.words, 3 + i)}]
                            for i, name in enumerate(MODELS)
                        }
                        turns = 0
                        for round_ in range(args.rounds):
                            for name in MODELS:
                                for kind in ("swap-back", "warm"):
                                    chat = chats[name]
                                    chat.append({"role": "user", "content": f"Round {round_}, {kind}: which box?"})
                                    ms, text = await turn(client, name, chat)
                                    chat.append({"role": "assistant", "content": text})
                                    turns += 1
                                    line = await lines.wait(turns)
                                    if round_ == 0:
                                        if kind == "swap-back":  # the conversation's very first turn
                                            cold.append(ms)
                                        continue  # the conversation's first turns are cold: no cache has them
                                    if kind == "warm":
                                        warm.append(ms)
                                    else:
                                        other = daemon.models.get(MODELS[1 - MODELS.index(name)])
                                        this = daemon.models.get(name)
                                        assert other is not None
                                        assert this is not None
                                        swapback.append(
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
                        bursts = await burst(client, daemon, args.burst)
                    pids = [child.pid for child in daemon.children() if child.pid is not None]
                    swaps = daemon.models.swaps
            finally:
                daemon.request_stop()
        left, alive = leftovers(runtime_dir, pids)
        return {
            "swapback": swapback,
            "warm": warm,
            "cold": cold,
            "burst": bursts,
            "swaps": swaps,
            "left": left,
            "alive": alive,
        }
    finally:
        route_log.removeHandler(lines)
        shutil.rmtree(runtime_dir, ignore_errors=True)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.rounds, args.words, args.burst = 2, 200, 4
    print(
        f"onebit models: two models (alpha ctx 4096, beta ctx 2048) through max_loaded = 1, {args.rounds} rounds of "
        f"a swap-back and a warm turn each, ~{args.words}-word conversations; a burst of {args.burst}; with the "
        "prefix store (a) and without (b)"
    )
    sides = {"(a) store": await run_side(args, store=True), "(b) no store": await run_side(args, store=False)}
    ok = True
    for name, side in sides.items():
        print(
            f"\n{name}: swap-back turns (time to first token; load_ms, the wait for the model's load: the other's"
            " unload, then this one's decoder start; tokens)"
        )
        heads = [("ttft ms", 10), ("load_ms", 10), ("(unload", 9), ("load)", 8), ("ttft-load", 11)]
        print("".join(f"{head:>{width}}" for head, width in [*heads, ("restored", 10), ("prefilled", 11)]))
        for s in side["swapback"]:
            print(
                f"{s['ttft_ms']:>10.1f}{s['load_ms']:>10.1f}{s['unload']:>9.0f}{s['decoder_load']:>8.0f}"
                f"{s['ttft_ms'] - s['load_ms']:>11.1f}{s['restored']:>10}{s['prefilled']:>11}"
            )
        print(f"warm turns: median {_median(side['warm']):.1f} ms over {len(side['warm'])}")
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
    if args.plot:
        bench_plot.write(args.plot, "scripts/bench models", model_figures(sides), quick=args.quick)
    return 0 if ok else 1


def model_figures(sides: dict[str, dict[str, Any]]) -> list[bench_plot.Panel]:
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
        bench_plot.Bars("first token: swap-back against warm and cold", "ms", turns, log_y=True),
        bench_plot.Bars("the ratios (medians)", "ratio", ratios, reference=1.0),
    ]
