"""``scripts/bench hosts``: several agents' sessions over three onebitd hosts behind HAProxy, one host
drained half way: affinity by conversation against the balancing the shipped config did before it.

Two sides run at once, each its own three onebitd hosts (each its own llama-server, on 127.0.0.2,
.3, .4) behind its own HAProxy, both from config/haproxy.cfg with one more server line:

    (a) affinity: the config as shipped (each request hashed by its conversation's key, consistently,
        with bounded load; docs/operations.md, "Affinity by conversation");
    (b) before: the same file with ``balance hdr(X-Session-Id)``, what it shipped until then: no
        common client sends that header, so every request went round-robin.

Agents: each has a system prompt of its own, and several sessions; the sessions of even agents send
a ``prompt_cache_key`` of their own (OpenAI's clients), those of odd agents none (their sessions
share the system prompt, and (a) hashes them all to one host).  Turn by turn, every session sends
its next turn, streamed, to both sides, one request at a time, the sides taking turns request by
request and the side that goes first swapped each turn: a swing of the machine's speed falls on both,
and no request comes right after its own side's (whose host may still be saving that slot for the
prefix store).  After half the turns, on each side, the host that served the most
sessions' last turns is drained (``onebitctl drain``), and the turns go on on the other two.

Per side: time to first token over turns 2 and later (median, p90, before and after the drain), the
cold re-prefills (a turn whose host's cache held less than the whole of its previous turn's prompt:
``timings.cache_n`` below the previous turn's prompt tokens) and the prompt tokens prefilled again
that way.  ``--shared-dir DIR`` gives side (a)'s hosts one prefix store directory
(``cache.shared_dir``, for a onebitd that has it; one that does not refuses the key, exit 2).  Each
side starts from empty stores: (b)'s hosts and (a)'s private ones are made under a new directory, and
a ``--shared-dir`` that holds anything is refused (the sessions are greedy and the same run to run,
so an earlier run's entries would serve any turn, the ones after the drain included).

``--aa``: the A/A run.  Side (b) gets the shipped config too, so both sides are (a): what one shows
against the other is what the method (two sides at once, the order alternating) favours.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, TextIO

import attrs
import httpx
import trio

from bench import plot
from bench.rig import BenchError, Noise, leaves, machine, spawn_onebitd
from bench.workloads import QUESTIONS as MULTITURN_QUESTIONS
from bench.workloads import TOPICS
from supervisor import config as configuration
from supervisor.config import Config

ROOT = Path(__file__).resolve().parent.parent

HAPROXY_CONFIG = ROOT / "config" / "haproxy.cfg"
SECOND_SERVER = 'server onebit2 "${ONEBIT_HOST2-10.0.0.12:8080}"'  # a third host's line goes after it
AFFINITY_BALANCE = "balance hash var(txn.affinity)"
BEFORE_BALANCE = "balance hdr(X-Session-Id)"  # config/haproxy.cfg before affinity by conversation
HOSTS = 3
SIDES = ("(a) affinity", "(b) before")
AA_SIDES = ("(a) affinity", "(b) affinity, A/A")
CHECK_INTER = "100ms"  # HAProxy sees the drain within a fraction of a second (the example: 2 s)
TIMEOUT_S = 600
# multiturn's topics and questions, with two questions more: a host's session runs 8 turns and more.
QUESTIONS = (
    *MULTITURN_QUESTIONS[:5],
    "Name a common mistake.",
    "What changed in the last century?",
    *MULTITURN_QUESTIONS[5:],
)


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--agents", type=int, default=4, help="agents, each its own system prompt (4)")
    parser.add_argument("--sessions", type=int, default=2, help="sessions per agent (2)")
    parser.add_argument("--turns", type=int, default=8, help="turns per session; the drain comes after half (8)")
    parser.add_argument("--system-words", type=int, default=1200, help="words of system prompt (~1,600 tokens)")
    parser.add_argument("--max-tokens", type=int, default=8, help="reply tokens per turn (8)")
    parser.add_argument("--parallel", type=int, default=2, help="slots per host (2)")
    parser.add_argument(
        "--shared-dir", type=Path, help="side (a)'s hosts share this prefix store (cache.shared_dir): empty or absent"
    )
    parser.add_argument("--log", type=Path, help="keep the hosts' and HAProxy's logs here (default: discarded)")
    parser.add_argument("--quick", action="store_true", help="2 agents, 1 session each, 4 turns, short prompts")
    parser.add_argument("--aa", action="store_true", help="A/A: side (b) runs the shipped config as well")


def system_prompt(topic: str, words: int) -> str:
    facts = [f"Fact {i} about {topic}: it matters in way number {i * 7 % 31} for reason {i % 5}." for i in range(400)]
    text = f"You are a friendly expert on {topic}. Answer briefly. Here is your reference sheet. "
    return " ".join((text + " ".join(facts)).split()[:words])


def used_store(directory: Path) -> str | None:
    """Why ``directory`` cannot be side (a)'s shared store (None: it is empty, or absent and onebitd
    makes it): an earlier run's entries would serve this run's turns, and (b)'s stores start empty."""
    try:
        held = sorted(path.name for path in directory.iterdir())
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"--shared-dir {directory}: {exc.strerror or exc}"
    if held:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        return (
            f"--shared-dir {directory} holds {len(held)} entries ({shown}): each side starts from an empty"
            " store, so give an empty or new directory"
        )
    return None


def host_config(directory: Path, address: str, args: argparse.Namespace, shared: Path | None) -> Config:
    """onebitd's defaults on ``address`` port 0, the plain route, one decoder thread."""
    data = configuration.unstructure(Config())
    data["server"].update(host=address, port=0, runtime_dir=str(directory), shutdown_grace_s=10.0)
    data["cache"]["dir"] = str(directory / "prefix")  # never the user's own store
    if shared is not None:
        data["cache"]["shared_dir"] = str(shared)
    data["model"].update(parallel=args.parallel, ctx_size=4096 * args.parallel)  # the prompt and 8 turns, per slot
    data["decoder"]["threads"] = 1
    data["hybrid"]["enabled"] = False
    config = configuration.structure(data, "bench hosts")
    configuration.check(config, "bench hosts")
    return config


def haproxy_text(side: str) -> str:
    """config/haproxy.cfg with a third server line; side (b) with the balance line it had before
    (in an A/A run, whose sides are AA_SIDES, the shipped one)."""
    text = HAPROXY_CONFIG.read_text()
    for needed in (SECOND_SERVER, AFFINITY_BALANCE):
        if text.count(needed) != 1:
            raise RuntimeError(f"{HAPROXY_CONFIG} should name {needed!r} once")
    text = text.replace(SECOND_SERVER, SECOND_SERVER + '\n    server onebit3 "${ONEBIT_HOST3}"')
    return text if side != SIDES[1] else text.replace(AFFINITY_BALANCE, BEFORE_BALANCE)


@attrs.define
class Side:
    name: str
    url: str
    stats: Path  # HAProxy's admin socket
    admin: list[Path]  # each host's onebitd admin socket, onebit1 first
    pid: int  # HAProxy's


async def haproxy_command(stats: Path, line: str) -> str:
    stream = await trio.open_unix_socket(str(stats))
    async with stream:
        await stream.send_all(line.encode() + b"\n")
        chunks = []
        while data := await stream.receive_some():
            chunks.append(data)
    return b"".join(chunks).decode()


async def wait_status(stats: Path, server: str, status: str) -> None:
    """Until HAProxy's ``show stat`` says ``status`` for ``server`` (polled: its checks tell nobody)."""
    with trio.fail_after(TIMEOUT_S):
        while True:
            rows = (await haproxy_command(stats, "show stat")).lstrip("# ").splitlines()
            fields = rows[0].split(",")
            for row in rows[1:]:
                values = dict(zip(fields, row.split(","), strict=False))
                if (values.get("pxname"), values.get("svname"), values.get("status")) == ("onebit", server, status):
                    return
            await trio.sleep(0.05)


@asynccontextmanager
async def open_haproxy(directory: Path, side: str, endpoints: Sequence[str], log: TextIO) -> AsyncIterator[Side]:
    program = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/sbin")
    if program is None:
        raise RuntimeError("no haproxy: run scripts/setup (as root it installs Debian's haproxy package)")
    config = directory / "haproxy.cfg"
    config.write_text(haproxy_text(side))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    stats = directory / "haproxy.sock"
    env = {
        **os.environ,
        "ONEBIT_LB_BIND": f"fd@{listener.fileno()}",
        **{f"ONEBIT_HOST{i}": endpoint for i, endpoint in enumerate(endpoints, start=1)},
        "ONEBIT_CHECK_INTER": CHECK_INTER,
        "ONEBIT_LB_SOCKET": str(stats),
    }
    with listener:
        process = await trio.lowlevel.open_process(
            [program, "-db", "-f", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            pass_fds=(listener.fileno(),),
        )
        try:
            with trio.fail_after(TIMEOUT_S):
                while not stats.exists():  # polled: HAProxy makes it once it has parsed its config
                    if process.returncode is not None:
                        raise RuntimeError(f"haproxy exited {process.returncode} (its log: --log)")
                    await trio.sleep(0.05)
            for i in range(1, len(endpoints) + 1):
                await wait_status(stats, f"onebit{i}", "UP")
            address, port = listener.getsockname()
            yield Side(side, f"http://{address}:{port}", stats, [], process.pid)
        finally:
            with trio.CancelScope(shield=True):
                process.send_signal(signal.SIGTERM)
                with trio.move_on_after(10):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                await process.wait()


@attrs.frozen
class Sample:
    side: str
    turn: int  # 1-based
    session: int
    host: str
    ttft_ms: float
    prompt_tokens: int  # prompt_n + cache_n
    cache_n: int
    refilled: int  # the previous turn's prompt tokens its host's cache did not hold (0 on turn 1)


class Session:
    """One agent's conversation on one side: its history, with or without a key."""

    def __init__(self, index: int, system: str, key: str | None) -> None:
        self.index = index
        self.key = key
        self.history: list[dict[str, str]] = [{"role": "system", "content": system}]
        self.last_prompt = 0
        self.last_host = ""

    async def turn(self, client: httpx.AsyncClient, side: str, t: int, max_tokens: int) -> Sample:
        self.history.append({"role": "user", "content": QUESTIONS[(t - 1) % len(QUESTIONS)]})
        body: dict[str, Any] = {"messages": self.history, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        if self.key is not None:
            body["prompt_cache_key"] = self.key
        start = time.perf_counter()
        first: float | None = None
        text = ""
        timings: dict[str, Any] = {}
        async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"{side} answered {reply.status_code}: {(await reply.aread())[:300]!r}")
            host = reply.headers.get("x-onebit-host", "?")
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                for choice in data.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        first = first or time.perf_counter()
                        text += piece
                timings = data.get("timings", timings)
        self.history.append({"role": "assistant", "content": text})
        cache_n = int(timings.get("cache_n", 0))
        prompt = int(timings.get("prompt_n", 0)) + cache_n
        refilled = max(0, self.last_prompt - cache_n) if t > 1 else 0
        self.last_prompt, self.last_host = prompt, host
        ttft = ((first or time.perf_counter()) - start) * 1000
        return Sample(side, t, self.index, host, ttft, prompt, cache_n, refilled)


def sessions_of(args: argparse.Namespace) -> list[Session]:
    made: list[Session] = []
    for agent in range(args.agents):
        system = system_prompt(
            TOPICS[agent % len(TOPICS)] + (f" {agent}" if agent >= len(TOPICS) else ""), args.system_words
        )
        for s in range(args.sessions):
            key = f"agent{agent}-session{s}" if agent % 2 == 0 else None
            made.append(Session(len(made), system, key))
    return made


async def drain_busiest(side: Side, sessions: Sequence[Session]) -> str:
    """Drain the host that served the most sessions' last turns, and wait until HAProxy took it out."""
    busiest = Counter(session.last_host for session in sessions).most_common(1)[0][0]
    socket_path = side.admin[int(busiest.removeprefix("onebit")) - 1]
    ctl = Path(sys.executable).parent / "onebitctl"
    done = await trio.run_process([str(ctl), "--socket", str(socket_path), "drain"], capture_stdout=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{side.name}: onebitctl drain {busiest} exited {done.returncode}")
    await wait_status(side.stats, busiest, "DOWN")
    return busiest


def med(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] if ordered else float("nan")


def hosts_figures(samples: Sequence[Sample], half: int, names: Sequence[str] = SIDES) -> list[plot.Panel]:
    """Per turn, each session's first token on each side, and the prompt tokens its host's cache
    lacked, the drain marked."""
    drain = [(half + 0.5, "one host drained")]
    return [
        plot.XY(
            "first token per turn, every session",
            "turn",
            "first token, ms",
            {name: [(s.turn, s.ttft_ms) for s in samples if s.side == name] for name in names},
            marks=drain,
            integer_x=True,
            log_y=True,
        ),
        plot.XY(
            "the last turn's prompt tokens its host's cache lacked",
            "turn",
            "tokens",
            {name: [(s.turn, float(s.refilled)) for s in samples if s.side == name] for name in names},
            marks=drain,
            integer_x=True,
        ),
    ]


def report(args: argparse.Namespace, samples: Sequence[Sample], drained: dict[str, str]) -> None:
    names = AA_SIDES if args.aa else SIDES
    half = args.turns // 2
    print()
    print(f"{'turn':<6}" + "".join(f"{name + ' ttft ms':>28}{'cold':>6}" for name in names))
    for t in range(1, args.turns + 1):
        cells = ""
        for name in names:
            row = [s for s in samples if s.side == name and s.turn == t]
            cells += f"{med([s.ttft_ms for s in row]):>28.1f}{sum(s.refilled > 0 for s in row):>6}"
        print(f"{t:<6}{cells}" + ("   <- after the drain" if t == half + 1 else ""))
    print()
    totals = {}
    for name in names:
        later = [s for s in samples if s.side == name and s.turn > 1]
        before = [s.ttft_ms for s in later if s.turn <= half]
        after = [s.ttft_ms for s in later if s.turn > half]
        totals[name] = sum(s.ttft_ms for s in later)
        hosts = dict(sorted(Counter(s.host for s in samples if s.side == name).items()))
        print(
            f"{name}: turns 2..{args.turns} first token median {med([s.ttft_ms for s in later]):.1f} ms, "
            f"p90 {p90([s.ttft_ms for s in later]):.1f} ms; before the drain median {med(before):.1f}, "
            f"after {med(after):.1f}; cold re-prefills {sum(s.refilled > 0 for s in later)} of {len(later)} turns, "
            f"{sum(s.refilled for s in later)} prompt tokens prefilled again; drained {drained[name]}; "
            f"turns per host {hosts}"
        )
    a, b = totals[names[0]], totals[names[1]]
    aim = "   (A/A: both sides the shipped config)" if args.aa else ""
    print(f"summed first-token time, turns 2..{args.turns}: (a)/(b) {a / b:.3f}{aim}")


async def run(args: argparse.Namespace) -> int:
    """Each host is onebitd in a process of its own (bench/rig.py's ``spawn_onebitd`` starts, stops and reaps it)."""
    if args.quick:
        args.agents, args.sessions, args.turns, args.system_words = 2, 1, 4, 80
    if args.aa and args.shared_dir:
        raise BenchError("--aa and --shared-dir: an A/A run gives both sides the same config, one store each")
    if args.shared_dir is not None and (why := used_store(args.shared_dir)) is not None:
        raise BenchError(why)
    names = AA_SIDES if args.aa else SIDES
    store = f"shared store {args.shared_dir}" if args.shared_dir else "each host its own prefix store"
    print(
        f"onebit hosts: {HOSTS} hosts per side behind HAProxy, {args.agents} agents x {args.sessions} sessions x "
        f"{args.turns} turns (keys: the even agents' sessions), ~{args.system_words} words of system prompt, "
        f"{args.max_tokens} reply tokens, {args.parallel} slots per host, {store} on (a); the busiest host "
        f"drained after turn {args.turns // 2}" + ("; A/A: (b) runs the shipped config too" if args.aa else "")
    )
    print(machine())
    top = Path(tempfile.mkdtemp(prefix="ob-bench-", dir="/tmp"))
    try:
        log_path = Path(args.log) if args.log else top / "hosts.log"
        with log_path.open("w") as log:
            async with AsyncExitStack() as stack:
                sides = []
                ours: list[int | None] = [os.getpid()]  # the CPU the run itself takes is not noise
                for s, name in enumerate(names):
                    shared = args.shared_dir if s == 0 else None
                    endpoints, admin = [], []
                    for i in range(HOSTS):
                        directory = top / f"side{s}-host{i + 1}"
                        directory.mkdir()
                        config = host_config(directory, f"127.0.0.{2 + i}", args, shared)
                        spawned = await stack.enter_async_context(spawn_onebitd(config, directory, log))
                        ours += [spawned.pid, spawned.decoder_pid]
                        endpoints.append(spawned.url.removeprefix("http://"))
                        admin.append(directory / "admin.sock")
                        print(f"  {name}: onebit{i + 1} ready at {spawned.url}", file=sys.stderr, flush=True)
                    balancer_dir = top / f"side{s}-haproxy"
                    balancer_dir.mkdir()
                    side = await stack.enter_async_context(open_haproxy(balancer_dir, name, endpoints, log))
                    side.admin = admin
                    sides.append(side)
                    ours.append(side.pid)
                clients = [
                    await stack.enter_async_context(httpx.AsyncClient(base_url=side.url, timeout=TIMEOUT_S))
                    for side in sides
                ]
                sessions = {side.name: sessions_of(args) for side in sides}
                samples: list[Sample] = []
                drained: dict[str, str] = {}
                noise = Noise.start(ours)
                for t in range(1, args.turns + 1):
                    if t == args.turns // 2 + 1:
                        for side in sides:
                            drained[side.name] = await drain_busiest(side, sessions[side.name])
                    # The sides take turns request by request, the one that goes first swapped each
                    # turn: no request follows its own side's, whose host may still be saving the slot
                    # it just served for the store (a per-pair flip let the second session of a
                    # keyless agent follow its sibling on the same host on one side only: an A/A
                    # run favoured (a) by 9%).
                    order = [0, 1] if t % 2 else [1, 0]
                    for i in range(len(sessions[names[0]])):
                        for s in order:
                            name = sides[s].name
                            samples.append(await sessions[name][i].turn(clients[s], name, t, args.max_tokens))
                    print(f"  turn {t} done", file=sys.stderr, flush=True)
                noisy = noise.report(ours)
        report(args, samples, drained)
        print(noisy)
        if args.plot:
            figures = hosts_figures(samples, args.turns // 2, names)
            plot.write(args.plot, "scripts/bench hosts", figures, quick=args.quick)
        return 0
    except* RuntimeError as group:  # raised inside the hosts' nurseries: a group
        raise BenchError("; ".join(str(exc) for exc in leaves(group))) from None
    finally:
        shutil.rmtree(top, ignore_errors=True)
