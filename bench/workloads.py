"""What the benchmarks send, and how they time it: the prompts, the short completions and concurrent
streams of ``overhead`` and ``versus`` (:class:`Side` keeps what one side measured), the first byte
and the longest gap of a stream, the first tokens of one prompt on every route, and the fidelity of
a provider measured as the start-time check measures it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import httpx
import trio

from bench import plot, trace
from bench.rig import HYBRID_TIMEOUT_S, BenchError, Rig
from supervisor.providers.llama import LlamaServerProvider
from supervisor.routes import fidelity

PROMPT = "The capital of France is"
# The chats' topics and questions (multiturn's, and hosts' with two questions more).
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
    records: list[trace.StreamRecord] = attrs.Factory(list)  # the last round's streams

    @property
    def token_rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


async def chat_turn(
    client: httpx.AsyncClient, messages: list[dict[str, str]], max_tokens: int, model: str | None = None
) -> tuple[float, str, int]:
    """Streams one chat turn (to ``model``, where named): time to the first token (ms), the reply, and
    the prompt_n of the stream's timings (llama-server's; -1 where none came)."""
    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if model is not None:
        body["model"] = model
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
    record = trace.StreamRecord(key=body["prompt"], sent=start)
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


def relay_figures(sides: dict[str, Side]) -> list[plot.Panel]:
    """``overhead``'s and ``versus``'s figures: each side's latencies and first tokens as distributions,
    its token rate round by round."""
    return [
        plot.Distribution(
            "(a) short completions: latency",
            "ms",
            {name: [s * 1000 for s in side.latencies] for name, side in sides.items()},
            log_x=True,  # the body within a few ms, a loaded machine's tail seconds out
        ),
        plot.Distribution(
            "(b) concurrent streams: first token",
            "ms",
            {name: [s * 1000 for s in side.first_tokens] for name, side in sides.items()},
        ),
        plot.Bars(
            "(b) concurrent streams: aggregate token rate, round by round",
            "tokens/s",
            {
                f"round {r + 1}": {name: side.round_rates[r : r + 1] for name, side in sides.items()}
                for r in range(max(len(side.round_rates) for side in sides.values()))
            },
        ),
    ]


async def prompt_of(decoder: httpx.AsyncClient, n_tokens: int, salt: int) -> tuple[str, int]:
    """A text prompt of about ``n_tokens`` tokens (by the decoder's tokenizer), different per salt."""
    words = " ".join(f"item {salt}-{i} is {i * 7 % 101} units;" for i in range(n_tokens))
    tokens = (await decoder.post("/tokenize", json={"content": words})).json()["tokens"][:n_tokens]
    text = (await decoder.post("/detokenize", json={"tokens": tokens})).json()["content"]
    count = len((await decoder.post("/tokenize", json={"content": text, "add_special": True})).json()["tokens"])
    return text, count


async def first_byte_ms(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Time to the first streamed token, and the last chunk's timings."""
    start = trio.current_time()
    first: float | None = None
    timings: dict[str, Any] = {}
    async with client.stream("POST", path, json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{path} answered {reply.status_code}: {(await reply.aread())[:300]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if first is None and data.get("content"):
                first = trio.current_time()
            timings = data.get("timings", timings)
    assert first is not None, "no token came"
    return (first - start) * 1000, timings


async def longest_gap(
    rig: Rig, stream_client: httpx.AsyncClient, intruder: httpx.AsyncClient, plain: bool, n: int, r: int = 0
) -> float:
    """A stream decodes; after its 8th token a 2k-token prompt arrives; its longest inter-token gap.
    The prompt is new text for each round ``r`` and route, so that no cache holds it."""
    prompt, _ = await prompt_of(rig.decoder, 2048, salt=7000 + 2 * r + (0 if plain else 1))
    gaps: list[float] = []
    arrived = trio.Event()

    async def stream() -> None:
        body = {"prompt": "Count slowly: one, two, three,", "n_predict": n, "temperature": 0, "stream": True}
        last: float | None = None
        tokens = 0
        async with stream_client.stream("POST", "/completion", json={**body, "ignore_eos": True}) as reply:
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = trio.current_time()
                if last is not None and arrived.is_set():
                    gaps.append(now - last)
                last = now
                tokens += 1
                if tokens == 8:
                    arrived.set()

    async def intrude() -> None:
        await arrived.wait()
        extra = {"cache_prompt": False} if plain else {}
        reply = await intruder.post("/completion", json={"prompt": prompt, "n_predict": 1, **extra})
        reply.raise_for_status()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream)
        nursery.start_soon(intrude)
    return max(gaps) * 1000


async def first_tokens(
    rigs: dict[str, Rig], samples: int, chosen: Sequence[int], aa: bool
) -> dict[int, dict[str, Any]]:
    """Per size: a warm-up sample, then ``samples``, each one fresh prompt asked on every side in
    the sample's order: plain (straight to the first rig's decoder), then each rig's file route."""
    first = next(iter(rigs.values()))
    sides = ("plain", *rigs)
    orders = tuple(itertools.permutations(sides))
    rows: dict[int, dict[str, Any]] = {}
    for size in chosen:
        cells: dict[str, list[float]] = {side: [] for side in sides}
        decoder_n: dict[str, list[int]] = {side: [] for side in rigs}
        count = 0
        for i in range(samples + 1):
            prompt, count = await prompt_of(first.decoder, size, salt=size * 100 + i)
            body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "stream": True}
            direct = {**body, "cache_prompt": False, "id_slot": 1}
            for side in orders[i % len(orders)]:
                if side == "plain":
                    ms, _ = await first_byte_ms(first.decoder, "/completion", direct)
                elif aa:
                    ms, _ = await first_byte_ms(rigs[side].decoder, "/completion", direct)
                else:
                    ms, timings = await first_byte_ms(rigs[side].front, "/completion", body)
                    if i:
                        decoder_n[side].append(int(timings.get("prompt_n", -1)))
                if i:  # the first sample warms every side up
                    cells[side].append(ms)
        rows[size] = {
            "tokens": count,
            **cells,
            "decoder_prompt_n": {side: max(n, default=-1) for side, n in decoder_n.items()},
        }
    return rows


async def fidelity_of(
    rig: Rig, provider: LlamaServerProvider, texts: Sequence[str], slot_context: int | None = None
) -> fidelity.Verdict:
    """The verdict over ``texts`` (those that fit ``slot_context``), measured as the start-time
    check measures it."""
    hybrid = rig.daemon.models.default.parts.hybrid
    assert hybrid is not None
    probe = fidelity.Probe(client=rig.daemon.models.default.client, handoff=hybrid.file, timeout_s=HYBRID_TIMEOUT_S)
    samples = []
    prompts = fidelity.fitting([await probe.tokens(text) for text in texts], slot_context)
    async with rig.daemon.models.default.parts.slots.hold() as slot:
        for i, tokens in enumerate(prompts):
            samples.append(await probe.sample(provider, slot, tokens, req=f"bench-fidelity-{i}"))
        rig.daemon.models.default.parts.slots.forget(slot)
    return fidelity.judge(samples)
