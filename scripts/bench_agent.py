"""``scripts/bench agent``: a coding agent's session, through anthropic-python and openai-python's Responses client.

A system prompt and tool definitions of about 3,000 tokens, then T turns (default 8), each adding the
assistant's reply, a tool call, its result and a short user message, the whole conversation re-sent
every turn, streamed, greedy.  Once through anthropic-python (``/v1/messages``) and once through
openai-python's Responses client (``/v1/responses``), on these sides, one after another:

    direct   the decoder's llama-server reached over its socket (onebitd's own, with the same flags)
    plain    onebitd with hybrid off: slot affinity and the prefix store
    hybrid   onebitd with a llama-server provider (the file route, the cost decision)
    restart  onebitd stopped and started again on the plain side's prefix store: the same session
    direct'  the same session straight to the restarted llama-server (its cache is gone)

Per turn the time to the first token (the first content event), and the ratios against direct side by
side; on hybrid, the prompt tokens the decoder evaluated on turn 1 (handed over: one or two).  Aims:
turns 2..T through onebitd at most 1.05x direct; after the restart, the first turn at least 5x faster
than direct's cold first turn.  Each session starts with its own line, so no side reuses another's
prefix; llama-server's host-memory prompt cache is off (``cache.ram_mib = 0``) on every side.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import attrs
import httpx2
import openai
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from supervisor import config as configuration  # noqa: E402
from supervisor.config import Config  # noqa: E402
from supervisor.daemon import Daemon  # noqa: E402
from supervisor.logs import ROUTE_LOGGER  # noqa: E402
from supervisor.testing import RouteLines, run_daemon  # noqa: E402

TIMEOUT_S = 900
CLIENTS = ("anthropic", "responses")
SCHEMA = {
    "type": "object",
    "properties": {"path": {"type": "string", "description": "a path relative to the repository root"}},
    "required": ["path"],
}
TOOL_NAMES = ("read_file", "list_dir", "run_tests", "grep", "apply_patch", "git_diff")


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--turns", type=int, default=8, help="turns per session (8)")
    parser.add_argument("--system-words", type=int, default=1650, help="words of system prompt (~3,000 tokens)")
    parser.add_argument("--max-tokens", type=int, default=8, help="reply tokens per turn (8)")
    parser.add_argument("--quick", action="store_true", help="3 turns, a ~600-token prompt: it runs")


def system_prompt(words: int) -> str:
    rules = [
        f"Rule {i}: before you change module_{i % 40}.py, read it, run the tests under tests/unit_{i % 9}, and keep "
        f"the change under {i % 5 + 2} lines."
        for i in range(600)
    ]
    text = "You are a careful coding agent in a Python repository. Use one tool per turn. " + " ".join(rules)
    return " ".join(text.split()[:words])


def anthropic_tools() -> list[dict[str, Any]]:
    return [
        {"name": n, "description": f"The {n} tool: {n.replace('_', ' ')} in the repository.", "input_schema": SCHEMA}
        for n in TOOL_NAMES
    ]


def responses_tools() -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "name": n,
            "description": f"The {n} tool: {n.replace('_', ' ')} in the repository.",
            "parameters": SCHEMA,
        }
        for n in TOOL_NAMES
    ]


def tool_result(turn: int) -> str:
    return "\n".join(f"def function_{turn}_{i}(value):\n    return value * {i} + {turn}" for i in range(12))


@attrs.define
class Session:
    """One agent session's conversation, as each API spells it."""

    client: str
    nonce: str  # the session's first line: no two sessions share a prefix
    system: str
    turns: int
    max_tokens: int
    history: list[dict[str, Any]] = attrs.Factory(list)

    def first(self) -> None:
        self.history = [{"role": "user", "content": "Find where the tests for the parser live and run them."}]

    def body(self) -> dict[str, Any]:
        system = f"Session {self.nonce}. {self.system}"
        if self.client == "anthropic":
            return {
                "model": "m",
                "system": system,
                "tools": anthropic_tools(),
                "messages": self.history,
                "max_tokens": self.max_tokens,
                "temperature": 0,
            }
        return {
            "model": "m",
            "instructions": system,
            "tools": responses_tools(),
            "input": self.history,
            "max_output_tokens": self.max_tokens,
            "temperature": 0,
        }

    def add(self, turn: int, reply: str) -> None:
        """The reply given back, a tool call, its result and the next short message."""
        name = TOOL_NAMES[turn % len(TOOL_NAMES)]
        question = f"Turn {turn + 1}: good, now check the next file."
        if self.client == "anthropic":
            call = {"type": "tool_use", "id": f"toolu_{turn}", "name": name, "input": {"path": f"src/m{turn}.py"}}
            result = {"type": "tool_result", "tool_use_id": f"toolu_{turn}", "content": tool_result(turn)}
            self.history += [
                {"role": "assistant", "content": [{"type": "text", "text": reply or "."}, call]},
                {"role": "user", "content": [result, {"type": "text", "text": question}]},
            ]
            return
        content = [{"type": "output_text", "text": reply or ".", "annotations": []}]
        self.history += [
            {"type": "message", "role": "assistant", "content": content},
            {
                "type": "function_call",
                "call_id": f"call_{turn}",
                "name": name,
                "arguments": f'{{"path": "src/m{turn}.py"}}',
            },
            {"type": "function_call_output", "call_id": f"call_{turn}", "output": tool_result(turn)},
            {"role": "user", "content": question},
        ]


async def turn_anthropic(client: anthropic.AsyncAnthropic, body: dict[str, Any]) -> tuple[float, str]:
    """First-token milliseconds and the reply's text, streamed."""
    start = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    # anthropic-python no longer takes ``temperature``: sent as an extra key, which llama-server keeps.
    greedy = {"temperature": body.pop("temperature")} if "temperature" in body else {}
    stream = await client.messages.create(**body, stream=True, extra_body=greedy)
    async for event in stream:
        if event.type == "content_block_delta":
            first = first or time.perf_counter()
            if event.delta.type == "text_delta":
                text.append(event.delta.text)
        elif event.type == "message_stop":
            first = first or time.perf_counter()
    return ((first or time.perf_counter()) - start) * 1000, "".join(text)


async def turn_responses(client: openai.AsyncOpenAI, body: dict[str, Any]) -> tuple[float, str]:
    start = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    stream = await client.responses.create(**body, stream=True)
    async for event in stream:
        if event.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
            first = first or time.perf_counter()
            if event.type == "response.output_text.delta":
                text.append(event.delta)
        elif event.type == "response.completed":
            first = first or time.perf_counter()
    return ((first or time.perf_counter()) - start) * 1000, "".join(text)


Asker = Callable[[dict[str, Any]], Awaitable[tuple[float, str]]]


@asynccontextmanager
async def askers(base_url: str, socket: Path | None = None) -> AsyncIterator[dict[str, Asker]]:
    """The two SDK clients on ``base_url``, or straight to llama-server over ``socket``."""

    def transport() -> httpx2.AsyncHTTPTransport | None:
        if socket is None:
            return None
        # A connection per request: llama-server (cpp-httplib) closes pooled keep-alive connections on
        # its own schedule, and a request sent on one then fails unanswered (supervisor/decoder.py's
        # FreshOnStale says more); a unix socket's connect costs next to nothing.
        limits = httpx2.Limits(max_connections=8, max_keepalive_connections=0)
        return httpx2.AsyncHTTPTransport(uds=str(socket), limits=limits, retries=1)

    timeout = httpx2.Timeout(TIMEOUT_S)
    async with (
        httpx2.AsyncClient(transport=transport(), timeout=timeout) as h1,
        httpx2.AsyncClient(transport=transport(), timeout=timeout) as h2,
    ):
        claude = anthropic.AsyncAnthropic(base_url=base_url, api_key="x", max_retries=0, http_client=h1)
        oai = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, http_client=h2)
        yield {
            "anthropic": lambda body: turn_anthropic(claude, body),
            "responses": lambda body: turn_responses(oai, body),
        }


async def run_session(ask: Asker, session: Session) -> list[float]:
    session.first()
    times: list[float] = []
    for turn in range(session.turns):
        ms, reply = await ask(session.body())
        times.append(ms)
        session.add(turn, reply)
    return times


def side_config(runtime_dir: Path, store: Path, *, hybrid: bool) -> Config:
    cpus = sorted(os.sched_getaffinity(0))
    decoder_cpus, provider_cpus = ([cpus[0]], [cpus[1]]) if len(cpus) >= 2 else (cpus, cpus)
    data = configuration.unstructure(Config())
    data["server"].update(port=0, runtime_dir=str(runtime_dir), shutdown_grace_s=10.0)
    data["cache"].update(dir=str(store), ram_mib=0, min_tokens=256)
    data["model"].update(parallel=2, ctx_size=16384)  # 8,192-token slots: the prompt and eight turns
    data["decoder"].update(threads=1, cpu_affinity=decoder_cpus)
    data["hybrid"].update(enabled=hybrid)
    data["provider"] = []
    if hybrid:
        data["provider"] = [{"kind": "llama-server", "name": "bench", "threads": 1, "cpu_affinity": provider_cpus}]
    config = configuration.structure(data, "bench")
    configuration.check(config, "bench")
    return config


@asynccontextmanager
async def open_side(config: Config) -> AsyncIterator[tuple[Daemon, str]]:
    async with run_daemon(config, ready_timeout_s=TIMEOUT_S) as running:
        # Ready, not only started: a provider takes jobs once its check against the decoder admitted
        # it, which comes after the decoder is up (a first turn before would go plain).
        with trio.fail_after(TIMEOUT_S):
            while not all(provider.ready for provider in running.daemon.providers.all):  # noqa: ASYNC110
                await trio.sleep(0.05)
        yield running.daemon, running.url


async def stores_settled(daemon: Daemon, n: int) -> None:
    """The store's writes run off the requests' path: wait for them to land before a restart."""
    with trio.fail_after(120):
        while daemon.store.statistics().stores < n:  # noqa: ASYNC110  # no event announces it
            await trio.sleep(0.05)


async def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.turns, args.system_words = 3, 400
    system = system_prompt(args.system_words)
    print(
        f"onebit agent: a {args.turns}-turn session (~{args.system_words}-word system prompt and {len(TOOL_NAMES)} "
        f"tools), {args.max_tokens} reply tokens a turn, through anthropic-python and openai-python's Responses "
        "client; first-token ms per turn"
    )
    lines = RouteLines()
    logger = logging.getLogger(ROUTE_LOGGER)
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    root = Path(tempfile.mkdtemp(prefix="ob-bench-", dir="/tmp"))
    store = root / "store"
    times: dict[tuple[str, str], list[float]] = {}
    seen: dict[tuple[str, str], list[dict[str, Any]]] = {}  # each onebitd session's route lines, in turn order

    def session(client: str, nonce: str) -> Session:
        return Session(client, nonce, system, args.turns, args.max_tokens)

    async def through(side: str, ask: Asker, client: str, nonce: str) -> None:
        before = len(lines.lines)
        times[side, client] = await run_session(ask, session(client, nonce))
        # A line is written when its request ends: after its reply, and after the slot is saved for
        # the prefix store, so the last turn's may come after its client has everything.
        with trio.fail_after(120):
            await lines.wait(before + args.turns)
        mine = lines.lines[before : before + args.turns]
        seen[side, client] = sorted(mine, key=lambda line: int(str(line["req"]).rsplit("-", 1)[1]))

    try:
        with trio.fail_after(TIMEOUT_S * 4):
            async with open_side(side_config(root / "plain", store, hybrid=False)) as (daemon, url):
                async with askers("http://decoder", daemon.launcher.socket) as direct, askers(url) as front:
                    for client in CLIENTS:
                        times["direct", client] = await run_session(direct[client], session(client, f"d-{client}"))
                        await through("plain", front[client], client, f"p-{client}")
                await stores_settled(daemon, 2)
            hybrid = side_config(root / "hybrid", root / "hybrid-store", hybrid=True)
            async with open_side(hybrid) as (daemon, url), askers(url) as front:
                for client in CLIENTS:
                    await through("hybrid", front[client], client, f"h-{client}")
            # A full restart: onebitd and its llama-server; the plain side's store is still on disk.
            async with (
                open_side(side_config(root / "plain", store, hybrid=False)) as (daemon, url),
                askers("http://decoder", daemon.launcher.socket) as direct,
                askers(url) as front,
            ):
                for client in CLIENTS:
                    await through("restart", front[client], client, f"p-{client}")
                    times["direct'", client] = await run_session(direct[client], session(client, f"d-{client}"))
    finally:
        logger.removeHandler(lines)
        shutil.rmtree(root, ignore_errors=True)

    for client in CLIENTS:
        base = times["direct", client]
        print()
        print(f"{client}:")
        print(
            f"{'turn':>4}{'direct':>10}{'plain':>10}{'/direct':>9}{'hybrid':>10}{'/direct':>9}"
            f"{'restart':>10}{'direct`':>10}{'direct`/restart':>17}"
        )
        for turn in range(args.turns):
            d, p, h = base[turn], times["plain", client][turn], times["hybrid", client][turn]
            r, c = times["restart", client][turn], times["direct'", client][turn]
            print(f"{turn + 1:>4}{d:>10.1f}{p:>10.1f}{p / d:>9.2f}{h:>10.1f}{h / d:>9.2f}", end="")
            print(f"{r:>10.1f}{c:>10.1f}{c / r:>17.2f}")
        later = slice(1, None)
        if args.turns > 1:
            plain_ratio = sum(times["plain", client][later]) / sum(base[later])
            hybrid_ratio = sum(times["hybrid", client][later]) / sum(base[later])
            print(
                f"turns 2-{args.turns}, summed: plain/direct {plain_ratio:.2f}x, hybrid/direct {hybrid_ratio:.2f}x"
                "   (aim: at most 1.05x)"
            )
        for side in ("plain", "hybrid", "restart"):
            turns = "  ".join(
                f"{line['slot']}:{line['route']}:{line['cached_tokens']}/{line['prompt_tokens']}"
                for line in seen[side, client]
            )
            print(f"{side:>8} slot:route:cached/prompt tokens per turn  {turns}")
        line = seen["hybrid", client][0]
        print(
            f"hybrid turn 1: route={line['route']} decoder evaluated {line['decoder_prompt_n']} of "
            f"{line['prompt_tokens']} prompt tokens   (aim: at most 2)"
        )
        line = seen["restart", client][0]
        first = times["direct'", client][0] / times["restart", client][0]
        print(
            f"after the restart, turn 1: direct' cold / onebitd {first:.2f}x   (aim: at least 5x); "
            f"restored {line['restored_tokens']} tokens, the decoder evaluated {line['decoder_prompt_n']}"
        )
        median = statistics.median(p / d for p, d in zip(times["plain", client], base, strict=True))
        print(f"median turn, plain/direct: {median:.2f}x")
    return 0
