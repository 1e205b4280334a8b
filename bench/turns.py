"""``scripts/bench turns``: per model family, an agent's session of 8 turns with a model swap and a
full restart between them, onebitd against llama-server direct.

The models: the tiny random-weight one of each family that scripts/tiny-models makes (dense,
sliding-window, hybrid recurrent, hybrid convolution, mamba2 hybrid, MoE) and SmolLM2, the embedded
default.  Per family one session: a long system prompt (an agent's instructions and tools), then
turn by turn a tool's output of a few hundred characters and a short reply, each turn re-sending
the whole conversation, streamed.  Two sides up at once, each asked every turn, the order
alternating turn by turn, and each answering one short chat of its own first (unmeasured):

    onebitd   the embedded default config (the plain route, the prefix store, llama-server's prompt
              cache) with two models and ``models.max_loaded = 1``: the family's ("first") and a
              second ("other": SmolLM2, or llama-dense for SmolLM2 itself), not preloaded
    direct    a llama-server of its own with the decoder's flags for "first" (its own slots,
              context checkpoints and ``--cache-ram`` prompt cache), on the decoder's CPU

Between turns ``swap`` and ``swap + 1`` (half-way) onebitd is asked one turn of the other model,
which unloads the first (its slots kept in the store), and the next turn loads it back.  llama-server
alone cannot hold two models in a one-model budget either: its side stops and starts again with the
same flags there (the other model's turn, on a server of its own, is left out on that side).
Between turns ``restart`` and ``restart + 1`` both sides stop and start again: onebitd a full
restart (a new Daemon on the same runtime directory and store), direct a new process, whose
in-memory caches are empty.  What each side can keep across those is what is compared: direct
nothing, onebitd its prefix store; every other turn both have their prompt in memory.

``--aa``: the direct side is a second onebitd like the first (its own runtime and store), the A/A
run: its ratios say how far apart two equal sides measure on this machine.

Printed per family and turn: each side's first token (ms), what each side's decoder evaluated (its
``prompt_n``), onebitd's tokens restored and its route line's ``fallback``; then per family the
ratios other / onebitd (above 1: onebitd sooner) of the cold first turn, the warm turns (median),
the swap-back turn, the restarted turn and the whole session's summed first tokens.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import attrs
import httpx
import trio

from bench import plot
from bench.rig import BenchError, Noise, machine, open_direct, open_lines, writes_settled
from bench.workloads import chat_turn
from supervisor import config as configuration
from supervisor.config import Config, locate
from supervisor.daemon import Daemon
from supervisor.errors import ConfigError
from supervisor.testing import RouteLines, run_daemon, unix_transport

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600
FAMILIES = {
    "dense": "llama-dense",
    "sliding-window": "gemma3-dense",
    "hybrid recurrent": "qwen35-dense",
    "hybrid convolution": "lfm2-dense",
    "mamba2 hybrid": "granitehybrid-dense",
    "MoE": "qwen3moe-moe",
    "SmolLM2": "",  # the embedded default
}
TOOLS = ("read_file", "grep", "run_tests", "list_dir", "edit_file", "git_diff")


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--turns", type=int, default=8, help="turns per session (8)")
    parser.add_argument("--system-words", type=int, default=600, help="words of system prompt (600)")
    parser.add_argument("--tool-words", type=int, default=60, help="words of each turn's tool output (60)")
    parser.add_argument("--max-tokens", type=int, default=16, help="reply tokens per turn (16)")
    parser.add_argument("--families", nargs="*", choices=list(FAMILIES), help="families (default: every one)")
    parser.add_argument("--aa", action="store_true", help="A/A: the direct side is a second onebitd")
    parser.add_argument("--quick", action="store_true", help="dense and hybrid recurrent, 4 turns, short prompts")


def system_prompt(words: int) -> str:
    tools = " ".join(f"Tool {name}: call it with a path and a reason; it answers in plain text." for name in TOOLS)
    rules = [f"Rule {i}: keep change {i} small, test case {i * 7 % 31} first, and say why {i % 5}." for i in range(400)]
    text = f"You are a careful coding agent working in a repository. {tools} " + " ".join(rules)
    return " ".join(text.split()[:words])


def tool_output(turn: int, words: int) -> str:
    lines = [f"src/module_{turn}.py:{i * 13 % 97}: def step_{turn}_{i}(value): return value + {i}" for i in range(200)]
    return f"{TOOLS[turn % len(TOOLS)]} says: " + " ".join(" ".join(lines).split()[:words])


def model_file(name: str, tiny: Path) -> Path:
    embedded = locate.embedded_model()
    if not name:
        if embedded is None:
            raise ConfigError(["bench turns: no embedded model (run scripts/setup)"])
        return embedded
    path = tiny / f"{name}.gguf"
    if not path.is_file():
        raise ConfigError([f"bench turns: no {path} (run scripts/setup: it makes the test models)"])
    return path


def side_config(runtime_dir: Path, first: Path, other: Path) -> Config:
    """The embedded default config with two models in a one-model budget; the decoder on the first CPU."""
    data = configuration.unstructure(Config())
    data["server"].update(port=0, runtime_dir=str(runtime_dir), shutdown_grace_s=10.0)
    data["cache"]["dir"] = str(runtime_dir / "prefix")  # never the user's own store
    data["model"] = [
        {"name": "first", "path": str(first), "parallel": 2, "ctx_size": 8192},
        {"name": "other", "path": str(other), "parallel": 1, "ctx_size": 2048, "preload": False},
    ]
    data["models"] = {"max_loaded": 1}
    data["decoder"].update(threads=1, cpu_affinity=sorted(os.sched_getaffinity(0))[:1])
    config = configuration.structure(data, "bench")
    configuration.check(config, "bench")
    return config


@attrs.frozen
class Sample:
    ttft_ms: float
    prompt_tokens: int  # the decoder's prompt_n: what it evaluated
    restored: int | None  # onebitd's restored_tokens
    fallback: str
    load_ms: float = 0.0  # onebitd's wait for its model to load (the swap-back turn's)

    @property
    def ms(self) -> float:
        """The first token less the model's load: direct loaded its model again before the turn."""
        return self.ttft_ms - self.load_ms


@attrs.define
class Side:
    """One side: how it starts, stops and swaps; its conversation and what it measured."""

    name: str
    lines: RouteLines
    start: Callable[[AsyncExitStack], Awaitable[None]]
    swap: Callable[[], Awaitable[None]]
    messages: list[dict[str, str]]
    client: httpx.AsyncClient | None = None
    daemon: Daemon | None = None  # None: llama-server direct
    stack: AsyncExitStack | None = None
    samples: list[Sample] = attrs.Factory(list)

    async def up(self) -> None:
        self.stack = AsyncExitStack()
        await self.stack.__aenter__()
        await self.start(self.stack)

    async def down(self) -> None:
        if self.stack is not None:  # no shield here: its scope would close around the stack's nurseries
            await self.stack.aclose()
        self.stack = self.client = self.daemon = None

    async def ask(self, messages: list[dict[str, str]], max_tokens: int, model: str = "first") -> Sample:
        assert self.client is not None
        before = len(self.lines.lines)
        ttft, reply, prompt_n = await chat_turn(self.client, messages, max_tokens, model=model)
        messages.append({"role": "assistant", "content": reply})
        if self.daemon is None:
            return Sample(ttft, prompt_n, None, "direct")
        with trio.fail_after(120):  # the route line comes once the request is done and its slot saved
            line = await self.lines.wait(before + 1)
            await writes_settled(self.daemon)
        n, restored = int(line.get("decoder_prompt_n") or 0), line.get("restored_tokens")
        return Sample(ttft, n, restored, str(line.get("fallback") or "-"), float(line.get("load_ms") or 0.0))


def onebitd_side(name: str, config: Config, lines: RouteLines, other_chat: list[dict[str, str]]) -> Side:
    async def start(stack: AsyncExitStack) -> None:
        running = await stack.enter_async_context(run_daemon(config, ready_timeout_s=TIMEOUT_S))
        clients = await stack.enter_async_context(running.clients(request_timeout_s=TIMEOUT_S))
        side.daemon, side.client = running.daemon, clients.front

    async def swap() -> None:  # the other model asked: max_loaded = 1 unloads the first
        await side.ask(list(other_chat), 8, model="other")

    side = Side(name, lines, start, swap, [])
    return side


def direct_side(lines: RouteLines, first: Side, root: Path) -> Side:
    starts = iter(range(1000))

    async def start(stack: AsyncExitStack) -> None:
        assert first.daemon is not None  # its decoder's flags: the first model's
        directory = root / f"direct-{next(starts)}"
        socket = await stack.enter_async_context(open_direct(first.daemon, first.daemon.config, directory))
        side.client = await stack.enter_async_context(
            httpx.AsyncClient(transport=unix_transport(socket), base_url="http://direct", timeout=TIMEOUT_S)
        )

    async def swap() -> None:  # llama-server alone: the other model means this one stopped and started again
        await side.down()
        await side.up()

    side = Side("direct", lines, start, swap, [])
    return side


def events(args: argparse.Namespace) -> dict[int, str]:
    """The turn (1-based) each event comes before: the swap half-way, the restart two turns on."""
    swap = max(2, args.turns // 2)
    return {swap: "swap-back", min(args.turns, swap + 2): "restart"}


async def session(family: str, first_path: Path, other_path: Path, args: argparse.Namespace) -> list[Side]:
    root = Path(tempfile.mkdtemp(prefix="ob-bench-", dir="/tmp"))
    other_chat = [{"role": "user", "content": "Say hello."}]
    conversation = [{"role": "system", "content": system_prompt(args.system_words)}]
    try:
        async with open_lines() as lines:
            a = onebitd_side("onebitd", side_config(root / "a", first_path, other_path), lines, other_chat)
            if args.aa:
                b = onebitd_side("onebitd A/A", side_config(root / "b", first_path, other_path), lines, other_chat)
            else:
                b = direct_side(lines, a, root)
            sides = [a, b]
            with trio.fail_after(TIMEOUT_S * 3):  # the sides stopped inside it: their nurseries nest in it
                try:
                    for side in sides:
                        await side.up()
                        await side.ask([{"role": "user", "content": f"Warm-up for {side.name}: say hi."}], 4)
                        side.messages = list(conversation)
                    at = events(args)
                    for t in range(1, args.turns + 1):
                        if at.get(t) == "swap-back":
                            for side in sides:
                                await side.swap()
                        elif at.get(t) == "restart":  # stopped innermost first, started in order (a
                            for side in sides[::-1]:  # side's nurseries nest in those before it): direct
                                await side.down()  # then takes the flags of the new decoder
                            for side in sides:
                                await side.up()
                        for side in sides if t % 2 else sides[::-1]:
                            side.messages.append({"role": "user", "content": tool_output(t, args.tool_words)})
                            side.samples.append(await side.ask(side.messages, args.max_tokens))
                        print(f"  {family}: turn {t} done", file=sys.stderr, flush=True)
                finally:
                    for side in sides[::-1]:
                        await side.down()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return sides


def ratio(top: float, bottom: float) -> str:
    return f"{top / bottom:>6.2f}x" if bottom > 0 else f"{'-':>7}"


async def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.turns, args.system_words, args.tool_words = 4, 200, 30
        args.families = args.families or ["dense", "hybrid recurrent"]
    if args.turns < 4:
        raise BenchError("bench turns: --turns must be at least 4 (a swap and a restart between turns)")
    found = await trio.run_process(
        [str(ROOT / "scripts" / "tiny-models"), "--print-path", sys.executable], capture_stdout=True
    )
    tiny = Path(found.stdout.decode().strip())
    other = "B" if args.aa else "direct"
    at = events(args)
    print(f"machine: {machine()}")
    print(
        f"onebit turns: per family one session of {args.turns} turns, ~{args.system_words} words of system prompt, "
        f"~{args.tool_words} words of tool output and {args.max_tokens} reply tokens a turn; the other model asked"
        f" before turn {min(at)}, both sides restarted before turn {max(at)}; the sides alternate turn by turn"
        + ("; A/A: B is a second onebitd" if args.aa else "")
    )
    noise = Noise.start([])
    rows: dict[str, list[Side]] = {}
    print(
        f"{'family':<20} {'turn':>4} {'event':<9} {'onebitd ms':>10} {'load':>7} {other + ' ms':>10} {'ratio':>7}"
        f" {'restored':>8} {'onebitd n':>9} {other + ' n':>9}  fallback"
    )
    for family in args.families or list(FAMILIES):
        name = FAMILIES[family]
        first_path = model_file(name, tiny)
        other_path = model_file("llama-dense" if not name else "", tiny)
        a, b = rows[family] = await session(family, first_path, other_path, args)
        for t, (x, y) in enumerate(zip(a.samples, b.samples, strict=True), 1):
            print(
                f"{family:<20} {t:>4} {at.get(t, 'cold' if t == 1 else 'warm'):<9}"
                f" {x.ttft_ms:>10.0f} {x.load_ms:>7.0f} {y.ttft_ms:>10.0f}"
                f" {ratio(y.ms, x.ms)} {x.restored if x.restored is not None else '-':>8}"
                f" {x.prompt_tokens:>9} {y.prompt_tokens:>9}  {x.fallback or '-'}",
                flush=True,
            )
    print()
    print(
        f"load: onebitd's wait for its model (max_loaded = 1), left out of the ratios ({other} loaded before the turn)"
    )
    print(f"{other} / onebitd, first token (above 1: onebitd sooner); warm: the median of the warm turns' ratios")
    print(f"{'family':<20} {'model':<24} {'cold':>7} {'warm':>7} {'swap':>7} {'restart':>7} {'session':>7}")
    for family, (a, b) in rows.items():
        pairs = [(y.ms, x.ms) for x, y in zip(a.samples, b.samples, strict=True)]
        warm = [y / x for t, (y, x) in enumerate(pairs, 1) if t > 1 and t not in at]
        swap, restart = (pairs[t - 1] for t in sorted(at))
        print(
            f"{family:<20} {FAMILIES[family] or 'SmolLM2-135M-Instruct':<24} {ratio(*pairs[0])}"
            f" {statistics.median(warm):>6.2f}x {ratio(*swap)} {ratio(*restart)}"
            f" {ratio(sum(y for y, _ in pairs), sum(x for _, x in pairs))}"
        )
    print(noise.report([]))
    if args.plot:
        plot.write(args.plot, "scripts/bench turns", turn_figures(rows, at, other), quick=args.quick)
    return 0


def turn_figures(rows: dict[str, list[Side]], at: dict[int, str], other: str) -> list[plot.Panel]:
    marks = [(t - 0.5, event) for t, event in sorted(at.items())]
    return [
        plot.XY(
            f"{other} / onebitd, first token per turn (above 1: onebitd sooner)",
            "turn",
            "ratio",
            {
                family: [(t, y.ms / x.ms) for t, (x, y) in enumerate(zip(a.samples, b.samples, strict=True), 1)]
                for family, (a, b) in rows.items()
            },
            marks=marks,
            integer_x=True,
            log_y=True,
        ),
        plot.XY(
            "prompt tokens the decoder evaluated per turn",
            "turn",
            "tokens",
            {
                f"{family}, {side.name}": [(t, float(s.prompt_tokens)) for t, s in enumerate(side.samples, 1)]
                for family, sides in rows.items()
                for side in sides
            },
            marks=marks,
            integer_x=True,
            log_y=True,
        ),
    ]
