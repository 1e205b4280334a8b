"""``scripts/bench agent``: a coding agent's session, through anthropic-python and openai-python's Responses client.

A system prompt and tool definitions of about 3,000 tokens, then T turns (default 8), each adding the
assistant's reply, a tool call, its result and a short user message, the whole conversation re-sent
every turn, streamed, greedy.  Once through anthropic-python (``/v1/messages``) and once through
openai-python's Responses client (``/v1/responses``), on these sides:

    direct   a llama-server of its own with the decoder's flags and CPU (one per onebitd below)
    plain    onebitd with hybrid off: slot affinity and the prefix store
    at once  plain again, each turn sent the moment the last one's stream ended, as an agent does
    hybrid   onebitd with a llama-server provider (the file route, the cost decision), with a direct
             side of its own
    restart  onebitd stopped and started again on the plain side's prefix store: the same session
    direct'  the direct session again, on a llama-server started afresh (its cache is gone)

Each onebitd side runs turn by turn with its direct one, the order swapped every turn (ABBA), so
the machine's drift falls on both alike; after each onebitd turn the bench waits for its route line
and the prefix store's write, so the next turn of either side runs on a quiet machine.  What that
wait hides is measured beside it: ``keep``, how long the request held its slot after its last event
(the save for the store, which a next turn sent at once would wait behind), and the ``at once`` side.

Per turn the time to the first token (the first content event), and the ratios against direct side by
side; on hybrid, the prompt tokens the decoder evaluated on turn 1 (handed over: one or two).  Aims:
turns 2..T through onebitd at most 1.05x direct; after the restart, the first turn at least 5x faster
than direct's cold first turn.  Each session starts with its own line, so no side reuses another's
prefix; llama-server's host-memory prompt cache is off (``cache.ram_mib = 0``) on every side.

``--aa``: the A/A run of the turn-by-turn method.  Two direct sides, each a llama-server of its own
with the plain decoder's flags, run turn by turn the same way (ABBA, the same sessions); what the
second shows against the first is what the method favours, the noise the plain side's ratio is read
against.  The restart headline (a restored onebitd against a cold llama-server's prefill) has none.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
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

from bench import plot
from bench.rig import Noise, machine, open_direct, writes_settled
from supervisor import config as configuration
from supervisor.config import Config
from supervisor.daemon import Daemon
from supervisor.observe.logs import ROUTE_LOGGER
from supervisor.testing import RouteLines, run_daemon

ROOT = Path(__file__).resolve().parent.parent

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
    parser.add_argument(
        "--restarts",
        type=int,
        default=6,
        help="full restarts measured on their first turn, the session's one included (6)",
    )
    parser.add_argument("--quick", action="store_true", help="3 turns, a ~600-token prompt, 2 restarts: it runs")
    parser.add_argument("--aa", action="store_true", help="A/A: two direct sides turn by turn, nothing else")


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


@attrs.frozen
class Turn:
    first_ms: float  # the request's start to its first content event
    text: str
    ended: float  # perf_counter when the stream's last event came


async def turn_anthropic(client: anthropic.AsyncAnthropic, body: dict[str, Any]) -> Turn:
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
    ended = time.perf_counter()
    return Turn(((first or ended) - start) * 1000, "".join(text), ended)


async def turn_responses(client: openai.AsyncOpenAI, body: dict[str, Any]) -> Turn:
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
    ended = time.perf_counter()
    return Turn(((first or ended) - start) * 1000, "".join(text), ended)


Asker = Callable[[dict[str, Any]], Awaitable[Turn]]


@asynccontextmanager
async def askers(base_url: str, socket: Path | None = None) -> AsyncIterator[dict[str, Asker]]:
    """The two SDK clients on ``base_url``, or straight to llama-server over ``socket``."""

    def transport() -> httpx2.AsyncHTTPTransport | None:
        if socket is None:
            return None
        # A connection per request: llama-server (cpp-httplib) closes pooled keep-alive connections on
        # its own schedule, and a request sent on one then fails unanswered (supervisor/testing.py's
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


@attrs.define
class Side:
    """One session on one side: how it is asked, and what each turn measured."""

    name: str
    ask: Asker
    session: Session
    daemon: Daemon | None = None  # onebitd's sides: their route lines, their prefix store
    first_ms: list[float] = attrs.Factory(list)
    keep_ms: list[float] = attrs.Factory(list)  # a turn's last event to its route line: the slot kept
    lines: list[dict[str, Any]] = attrs.Factory(list)
    # The session's first turn after each further full restart (``--restarts``), and its route lines.
    again: list[float] = attrs.Factory(list)
    again_lines: list[dict[str, Any]] = attrs.Factory(list)


async def lockstep(sides: list[Side], lines: RouteLines) -> None:
    """The sides' sessions turn by turn: turn k of each before turn k+1 of any, the order swapped
    every turn (ABBA), so that the machine's drift falls on both alike.  After an onebitd side's
    turn, its route line (written once the slot was saved for the prefix store) and the store's
    write of that file: the next turn, of either side, runs on a quiet machine."""
    for side in sides:
        side.session.first()
    for turn in range(sides[0].session.turns):
        for side in sides if turn % 2 == 0 else reversed(sides):
            before = len(lines.lines)
            got = await side.ask(side.session.body())
            side.first_ms.append(got.first_ms)
            side.session.add(turn, got.text)
            if side.daemon is None:
                continue
            with trio.fail_after(120):
                line = await lines.wait(before + 1)
                side.keep_ms.append((lines.at[before] - got.ended) * 1000)
                side.lines.append(line)
                await writes_settled(side.daemon)


async def at_once(side: Side, lines: RouteLines) -> None:
    """The session as an agent sends it: each turn the moment the last one's stream ended."""
    side.session.first()
    before = len(lines.lines)
    for turn in range(side.session.turns):
        got = await side.ask(side.session.body())
        side.first_ms.append(got.first_ms)
        side.session.add(turn, got.text)
    assert side.daemon is not None
    with trio.fail_after(120):
        await lines.wait(before + side.session.turns)
        mine = lines.lines[before : before + side.session.turns]
        side.lines = sorted(mine, key=lambda line: int(str(line["req"]).rsplit("-", 1)[1]))
        await writes_settled(side.daemon)


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
            while not all(provider.ready for provider in running.daemon.models.default.parts.providers.all):  # noqa: ASYNC110
                await trio.sleep(0.05)
        yield running.daemon, running.url


async def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.turns, args.system_words, args.restarts = 3, 400, 2
    system = system_prompt(args.system_words)
    print(
        f"onebit agent: a {args.turns}-turn session (~{args.system_words}-word system prompt and {len(TOOL_NAMES)} "
        f"tools), {args.max_tokens} reply tokens a turn, through anthropic-python and openai-python's Responses "
        "client; first-token ms per turn; "
        + (
            "A/A: two direct sides turn by turn (ABBA)"
            if args.aa
            else "each onebitd side turn by turn with a direct one (ABBA)"
        )
    )
    print(machine())
    noise = Noise.start([])  # this process's tree: the clients, onebitd and every llama-server
    if args.aa:
        await run_aa(args, system)
        print(noise.report([]))
        return 0
    lines = RouteLines()
    logger = logging.getLogger(ROUTE_LOGGER)
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    root = Path(tempfile.mkdtemp(prefix="ob-bench-", dir="/tmp"))
    store = root / "store"
    sides: dict[tuple[str, str], Side] = {}

    def side(name: str, client: str, ask: Asker, nonce: str, daemon: Daemon | None = None) -> Side:
        made = Side(name, ask, Session(client, nonce, system, args.turns, args.max_tokens), daemon)
        sides[name, client] = made
        return made

    plain = side_config(root / "plain", store, hybrid=False)
    hybrid = side_config(root / "hybrid", root / "hybrid-store", hybrid=True)
    try:
        with trio.fail_after(TIMEOUT_S * 4):
            async with (
                open_side(plain) as (daemon, url),
                open_direct(daemon, plain, root / "direct") as direct_socket,
                askers("http://direct", direct_socket) as direct,
                askers(url) as front,
            ):
                for client in CLIENTS:
                    await lockstep(
                        [
                            side("direct", client, direct[client], f"d-{client}"),
                            side("plain", client, front[client], f"p-{client}", daemon),
                        ],
                        lines,
                    )
                # As an agent sends it, the next turn at once: does it find its slot?
                for client in CLIENTS:
                    await at_once(side("at-once", client, front[client], f"a-{client}", daemon), lines)
            async with (
                open_side(hybrid) as (daemon, url),
                open_direct(daemon, hybrid, root / "direct-h") as direct_socket,
                askers("http://direct", direct_socket) as direct,
                askers(url) as front,
            ):
                for client in CLIENTS:
                    await lockstep(
                        [
                            side("direct-h", client, direct[client], f"dh-{client}"),
                            side("hybrid", client, front[client], f"h-{client}", daemon),
                        ],
                        lines,
                    )
            # A full restart: onebitd and its llama-server; the plain side's store is still on disk.
            async with (
                open_side(plain) as (daemon, url),
                open_direct(daemon, plain, root / "direct-restarted") as direct_socket,
                askers("http://direct", direct_socket) as direct,
                askers(url) as front,
            ):
                for client in CLIENTS:
                    await lockstep(
                        [
                            side("restart", client, front[client], f"p-{client}", daemon),
                            side("direct'", client, direct[client], f"d-{client}"),
                        ],
                        lines,
                    )
        # More full restarts, each measured on the session's first turn alone (it is the headline:
        # one sample a client per restart), the two sides' order alternating restart by restart.
        for cycle in range(1, args.restarts):
            await restart_again(args, plain, root / f"direct-restarted-{cycle}", system, lines, cycle, sides)
    finally:
        logger.removeHandler(lines)
        shutil.rmtree(root, ignore_errors=True)

    for client in CLIENTS:
        report(client, args.turns, {name: s for (name, c), s in sides.items() if c == client})
    report_restarts(sides, plain.decoder.threads)
    print(noise.report([]))
    if args.plot:
        figures = agent_figures({(name, client): s.first_ms for (name, client), s in sides.items()})
        plot.write(args.plot, "scripts/bench agent", figures, quick=args.quick, columns=3)
    return 0


async def run_aa(args: argparse.Namespace, system: str) -> None:
    """Two direct sides, each a llama-server of its own with the plain decoder's flags, turn by turn
    as the plain side runs with its direct one; onebitd is started only for its decoder's argv."""
    root = Path(tempfile.mkdtemp(prefix="ob-bench-", dir="/tmp"))
    plain = side_config(root / "plain", root / "store", hybrid=False)
    lines = RouteLines()
    sides: dict[tuple[str, str], Side] = {}
    try:
        with trio.fail_after(TIMEOUT_S * 2):
            async with (
                open_side(plain) as (daemon, _url),
                open_direct(daemon, plain, root / "direct") as first_socket,
                open_direct(daemon, plain, root / "direct-b") as second_socket,
                askers("http://direct", first_socket) as first,
                askers("http://direct", second_socket) as second,
            ):
                for client in CLIENTS:
                    pair = [
                        Side(
                            "direct", first[client], Session(client, f"d-{client}", system, args.turns, args.max_tokens)
                        ),
                        Side(
                            "direct-b",
                            second[client],
                            Session(client, f"b-{client}", system, args.turns, args.max_tokens),
                        ),
                    ]
                    await lockstep(pair, lines)
                    sides.update({(side.name, client): side for side in pair})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for client in CLIENTS:
        a, b = sides["direct", client].first_ms, sides["direct-b", client].first_ms
        print()
        print(f"{client} (A/A):")
        print(f"{'turn':>4}{'direct':>9}{'direct-b':>10}{'/direct':>8}")
        for t in range(args.turns):
            print(f"{t + 1:>4}{a[t]:>9.1f}{b[t]:>10.1f}{b[t] / a[t]:>8.2f}")
        median = statistics.median(y / x for x, y in zip(a, b, strict=True))
        if args.turns > 1:
            summed = sum(b[1:]) / sum(a[1:])
            print(
                f"turns 2-{args.turns}, summed: direct-b/direct {summed:.2f}x   (the plain side's aim: at most 1.05x)"
            )
        print(f"median turn, direct-b/direct: {median:.2f}x")


async def restart_again(
    args: argparse.Namespace,
    config: Config,
    directory: Path,
    system: str,
    lines: RouteLines,
    cycle: int,
    sides: dict[tuple[str, str], Side],
) -> None:
    """onebitd and a fresh direct llama-server started again on the plain side's store; the
    session's first turn on each, its first token added to the restart sides' figures."""
    async with (
        open_side(config) as (daemon, url),
        open_direct(daemon, config, directory) as direct_socket,
        askers("http://direct", direct_socket) as direct,
        askers(url) as front,
    ):
        for client in CLIENTS:
            restart = Side("restart", front[client], Session(client, f"p-{client}", system, 1, args.max_tokens), daemon)
            cold = Side("direct'", direct[client], Session(client, f"d-{client}", system, 1, args.max_tokens))
            await lockstep([restart, cold] if cycle % 2 == 0 else [cold, restart], lines)
            sides["restart", client].again.append(restart.first_ms[0])
            sides["direct'", client].again.append(cold.first_ms[0])
            sides["restart", client].again_lines.append(restart.lines[0])


def report_restarts(sides: dict[tuple[str, str], Side], threads: int) -> None:
    """The first turn after each full restart: the headline, from every restart, said as what it
    compares (a restore against the cold side's prefill on this machine, with the decoder's flags
    and ``threads``), since the ratio is this machine's prefill speed over a file read."""
    print()
    for client in CLIENTS:
        restart, cold = sides["restart", client], sides["direct'", client]
        ours = [restart.first_ms[0], *restart.again]
        theirs = [cold.first_ms[0], *cold.again]
        ratios = [c / r for r, c in zip(ours, theirs, strict=True)]
        evaluated = [line["decoder_prompt_n"] for line in [restart.lines[0], *restart.again_lines]]
        print(
            f"{client}: after {len(ours)} full restarts, turn 1: direct' cold / onebitd median"
            f" {statistics.median(theirs) / statistics.median(ours):.2f}x of the medians"
            f" ({statistics.median(ours):.0f} ms against {statistics.median(theirs):.0f} ms);"
            f" restart by restart {' '.join(f'{r:.2f}' for r in ratios)}   (aim: at least 5x);"
            f" the decoder evaluated {' '.join(str(n) for n in evaluated)} prompt tokens"
        )
        print(
            f"{client}: the first turn after a restart: restored in {statistics.median(ours):.0f} ms against a"
            f" prefill of {restart.lines[0]['prompt_tokens']} tokens in {statistics.median(theirs) / 1000:.1f} s"
            f" on this machine (the decoder's flags, {threads} thread{'s' if threads != 1 else ''})"
        )


# Each panel: an onebitd side against the direct side it ran turn by turn with.
PANELS = (
    ("plain, and at once", ("direct", "plain", "at-once")),
    ("hybrid", ("direct-h", "hybrid")),
    ("after a full restart", ("direct'", "restart")),
)


def agent_figures(first_ms: dict[tuple[str, str], list[float]]) -> list[plot.Panel]:
    """Per client (a row), per turn, each side's first token beside its direct side's."""
    return [
        plot.XY(
            f"{client}: {title}",
            "turn",
            "first token, ms",
            {name: [(t + 1, ms) for t, ms in enumerate(first_ms[name, client])] for name in names},
            integer_x=True,
            log_y=True,
        )
        for client in CLIENTS
        for title, names in PANELS
    ]


def report(client: str, turns: int, sides: dict[str, Side]) -> None:
    ms = {name: s.first_ms for name, s in sides.items()}
    print()
    print(f"{client}:")
    print(
        f"{'turn':>4}{'direct':>9}{'plain':>9}{'/direct':>8}{'keep':>7}{'direct':>9}{'hybrid':>9}{'/direct':>8}"
        f"{'restart':>9}{'direct`':>9}{'direct`/restart':>16}{'at once':>9}"
    )
    for t in range(turns):
        d, p, keep = ms["direct"][t], ms["plain"][t], sides["plain"].keep_ms[t]
        dh, h = ms["direct-h"][t], ms["hybrid"][t]
        r, c, a = ms["restart"][t], ms["direct'"][t], ms["at-once"][t]
        print(f"{t + 1:>4}{d:>9.1f}{p:>9.1f}{p / d:>8.2f}{keep:>7.1f}{dh:>9.1f}{h:>9.1f}{h / dh:>8.2f}", end="")
        print(f"{r:>9.1f}{c:>9.1f}{c / r:>16.2f}{a:>9.1f}")
    later = slice(1, None)
    if turns > 1:
        plain_ratio = sum(ms["plain"][later]) / sum(ms["direct"][later])
        hybrid_ratio = sum(ms["hybrid"][later]) / sum(ms["direct-h"][later])
        print(
            f"turns 2-{turns}, summed: plain/direct {plain_ratio:.2f}x, hybrid/direct {hybrid_ratio:.2f}x"
            "   (aim: at most 1.05x)"
        )
        kept = sides["plain"].keep_ms[later]
        print(
            f"plain's slot kept after the reply (the save for the prefix store), turns 2-{turns}: median "
            f"{statistics.median(kept):.1f} ms, max {max(kept):.1f} ms"
        )
    for name in ("plain", "at-once", "hybrid", "restart"):
        per_turn = "  ".join(
            f"{line['slot']}:{line['route']}:{line['cached_tokens']}/{line['prompt_tokens']}"
            for line in sides[name].lines
        )
        print(f"{name:>8} slot:route:cached/prompt tokens per turn  {per_turn}")
    estimates = "  ".join(
        f"{line['est_plain_ms'] or 0:.0f}/{line['est_hybrid_ms'] or 0:.0f}" for line in sides["hybrid"].lines
    )
    print(f"  hybrid the cost decision's estimates, plain/hybrid ms per turn  {estimates}")
    line = sides["hybrid"].lines[0]
    print(
        f"hybrid turn 1: route={line['route']} decoder evaluated {line['decoder_prompt_n']} of "
        f"{line['prompt_tokens']} prompt tokens   (aim: at most 2)"
    )
    line = sides["restart"].lines[0]
    first = ms["direct'"][0] / ms["restart"][0]
    print(
        f"after the restart, turn 1: direct' cold / onebitd {first:.2f}x   (aim: at least 5x); "
        f"restored {line['restored_tokens']} tokens, the decoder evaluated {line['decoder_prompt_n']}"
    )
    median = statistics.median(p / d for p, d in zip(ms["plain"], ms["direct"], strict=True))
    print(f"median turn, plain/direct: {median:.2f}x")
