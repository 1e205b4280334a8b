"""``scripts/bench routes`` and ``scripts/bench fleet``: the route chooser against the routes it
chooses between, and onebitd against the llama-server it fronts.

``routes``: one onebitd with the shipped config (config/onebit.toml; only the context raised, to
32,768 tokens over its 4 slots, so that one slot holds a 7,600-token prompt).  Per prompt size (256
to 7,600 tokens, new text every request, so nothing is cached anywhere), four sides in turn, the
order rotating each round: *default* (the config as shipped: the cost decision), *plain* (every
prompt kept plain: ``min_prompt_tokens`` out of reach), *file* (every prompt handed over:
``route_by = "length"``), and *default* again, an A/A pair that shows the noise.  The sides are
the same processes with other ``[hybrid]`` settings (``Completions.configure``, so onebitd runs in
this process: its clients share its event loop, on every side alike), and all four teach
the one cost model: the default side decides on rates measured at every size.  Time to the first
streamed token; medians per size; the routes the default side took; how near its estimates came.

``routes --streams N``: the same with N streams decoding through onebitd the whole time (short
prompts, replies of 256 tokens, each stream asking again as soon as its reply is over), the slots
raised to N + 1 so that the measured prompt has one of its own: the long prompt arrives while the
streams decode on the same cores, where a handoff spares them nothing unless the provider's compute
is apart from the decoder's.  Only the measured requests' route lines are read.

``fleet``: the shared-prefix workload of an agent fleet (the shape of inference-perf's
shared-prefix one): ``--groups`` (6) system prompts of 600 to 800 tokens, each request one of them
and a new 20 to 50-token question, 32 to 64 tokens out, streamed, two at a time.  *direct* is a
llama-server as onebitd starts it (its decoder, reached on its own socket, with hybrid off: its
own slots and prompt cache do all the reuse); *onebitd* is the shipped config through its front,
in a process of its own as in service (:func:`bench.rig.spawn_onebitd`; its route lines read back
from its JSON log): in this process it would share its event loop with the clients that time it.
First a warm-up, not counted: ``--warmup`` requests a side (a block's worth; 4 with ``--quick``)
on system prompts of their own, so that neither side's first block runs on a freshly started
decoder (:func:`warm_up`).  Then four blocks ABBA (direct, onebitd, onebitd,
direct); each side meets the same requests in the same order.  First-token median and p90 and
token throughput, onebitd over direct, and the paired figure (:func:`paired`) for each pair of
blocks; onebitd's route lines: requests handed over after a prefix-store restore, and the share
whose estimate came within 1.5x of the actual prefill (supervisor/observe/routestats.py's measure).
``fleet --aa``: the onebitd side is a second llama-server direct, started as the first: the ratios
it prints are the method's noise, against which onebitd's are read.

"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from bench import plot
from bench.rig import Noise, machine, open_lines, piped_lines, spawn_onebitd
from supervisor import config as configuration
from supervisor.admin.render import costs_line
from supervisor.config import Config
from supervisor.observe.routestats import accuracy_of
from supervisor.observe.status import from_wire
from supervisor.routeline import RouteLine
from supervisor.testing import RouteLines, Running, run_daemon

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "config" / "onebit.toml"
TIMEOUT_S = 900  # a 7,600-token prefill on one loaded core of a 2-core machine is minutes
SIZES = (256, 512, 1024, 2048, 4096, 7600)
QUICK_SIZES = (256, 1024)
SIDES = ("default", "plain", "file", "default again")
# A slot of SmolLM2's whole trained context: a 7,600-token prompt, its template and reply fit.
SLOT_TOKENS = 8192
STREAM_PROMPT_TOKENS = 40  # a decoding stream's prompt: far below every measured size
STREAM_REPLY_TOKENS = 256


def routes_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=5, help="measured rounds per size, sides rotating (5)")
    parser.add_argument("--sizes", help=f"prompt sizes in tokens, comma-separated (default {SIZES})")
    parser.add_argument("--quick", action="store_true", help=f"one round at {QUICK_SIZES} tokens")
    parser.add_argument("--streams", type=int, default=0, help="streams decoding while each prompt arrives (0)")
    lines_argument(parser)


def fleet_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--groups", type=int, default=6, help="system prompts shared by the requests (6)")
    parser.add_argument("--requests", type=int, default=32, help="requests per block; four blocks, ABBA (32)")
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight at once (2)")
    parser.add_argument("--quick", action="store_true", help="12 requests per block")
    parser.add_argument("--aa", action="store_true", help="A/A: the onebitd side is a second llama-server direct")
    parser.add_argument(
        "--warmup",
        type=count,
        help="requests a side first, on prompts of their own (a block; quick 4; 0 none)",
    )
    lines_argument(parser)


def count(text: str) -> int:
    """A number of requests: 0 or more (argparse's ``type``)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: not a count of requests (0 or more)")
    return value


def lines_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lines", type=Path, metavar="FILE", help="also write onebitd's route lines to FILE, one JSON object a line"
    )


def write_lines(path: Path | None, lines: Sequence[dict[str, Any]]) -> None:
    """The route lines as JSON lines, for a study of the estimates against the actuals."""
    if path is not None:
        path.write_text("".join(json.dumps(line, default=str) + "\n" for line in lines))


def shipped_config(runtime_dir: Path, *, hybrid: bool = True, **model: Any) -> Config:
    """config/onebit.toml with a port and directories of this run's own (never the user's store);
    ``hybrid`` False: no provider, the decoder alone."""
    data = configuration.unstructure(configuration.load(SHIPPED))
    data["server"].update(port=0, runtime_dir=str(runtime_dir), shutdown_grace_s=10.0)
    data["cache"]["dir"] = str(runtime_dir / "prefix")
    data["model"].update(model)
    if not hybrid:
        data["hybrid"]["enabled"] = False
        data["provider"] = []
    config = configuration.structure(data, str(SHIPPED))
    configuration.check(config, str(SHIPPED))
    return config


async def text_of(decoder: httpx.AsyncClient, n_tokens: int, rng: random.Random) -> str:
    """New text of about ``n_tokens`` tokens by the decoder's tokenizer: words of ``rng``'s drawing."""
    words = " ".join(f"{rng.choice(WORDS)} {rng.randrange(1000)}" for _ in range(n_tokens))
    tokens = (await decoder.post("/tokenize", json={"content": words})).json()["tokens"][:n_tokens]
    text: str = (await decoder.post("/detokenize", json={"tokens": tokens})).json()["content"]
    return text


WORDS = (
    "river",
    "stone",
    "lamp",
    "orbit",
    "cedar",
    "piano",
    "violet",
    "harbor",
    "copper",
    "meadow",
    "signal",
    "quartz",
)


@attrs.frozen
class Streamed:
    first_ms: float  # the request's start to its first content token
    total_ms: float
    tokens: int  # content chunks: one token each from llama-server
    # The decoder's own ``timings`` from the last chunk: prompt_n, prompt_ms, cache_n (empty: none came).
    timings: dict[str, Any] = attrs.field(factory=dict)


async def stream_chat(client: httpx.AsyncClient, body: dict[str, Any]) -> Streamed:
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    timings: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"answered {reply.status_code}: {(await reply.aread())[:300]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            timings = chunk.get("timings") or timings
            choices = chunk.get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                tokens += 1
                first = first if first is not None else time.perf_counter()
    if first is None:
        raise RuntimeError("no token came")
    return Streamed((first - start) * 1000, (time.perf_counter() - start) * 1000, tokens, timings)


async def measured_line(lines: RouteLines, before: int) -> dict[str, Any]:
    """The first route line after the ``before``-th of a measured request (a stream's prompt is short)."""
    n = before
    while True:
        n += 1
        line = await lines.wait(n)
        if line["prompt_tokens"] > 2 * STREAM_PROMPT_TOKENS:
            return line


async def decode(clients: Any, rng: random.Random, finished: list[int]) -> None:
    """One stream decoding through onebitd until cancelled: a short new prompt, a long reply, again."""
    while True:
        text = await text_of(clients.direct, STREAM_PROMPT_TOKENS, rng)
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": STREAM_REPLY_TOKENS}
        await stream_chat(clients.front, {**body, "temperature": 0, "ignore_eos": True})
        finished[0] += 1


def within(lines: Sequence[dict[str, Any]]) -> tuple[int, float | None]:
    """How many of ``lines`` the cost decision estimated, and the share of those within 1.5x."""
    ratios = [r for fields in lines if (r := accuracy_of(RouteLine(**fields))) is not None]
    if not ratios:
        return 0, None
    return len(ratios), sum(1 for _, _, v in ratios if 1 / 1.5 <= v <= 1.5) / len(ratios)


def decided(line: dict[str, Any]) -> str:
    """A route line's decision in a few words: the route, why, the estimates, the prefill it took."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    prefill = line["decoder_prompt_ms"] if line["route"] == "plain" else line["prefill_ms"] + line["restore_ms"]
    accuracy = accuracy_of(RouteLine(**line))
    restored = line.get("restored_tokens")
    return (
        f"{line['route']} ({line['fallback'] or 'chosen'}), {line['prompt_tokens']} tokens, {line['cached_tokens']}"
        f" cached{f' ({restored} restored)' if restored else ''}, {line['decoder_prompt_n']} evaluated;"
        f" estimated plain {ms(line['est_plain_ms'])} ms, hybrid {ms(line['est_hybrid_ms'])} ms;"
        f" prefill took {ms(prefill)} ms{'' if accuracy is None else f', actual/estimate {accuracy[2]:.2f}'}"
    )


def costs_of(running: Running) -> str:
    """What onebitd's cost model believes at the end of the run (``onebitctl status``'s costs line)."""
    completions = running.daemon.models.default.completions
    return f"onebitd's costs at the end: {costs_line(completions.rates.statistics(completions.decoder.generation))}"


async def spawned_costs(front: httpx.AsyncClient) -> str:
    """:func:`costs_of` for an onebitd in a process of its own: from its ``/onebit/status``."""
    stats = from_wire((await front.get("/onebit/status")).raise_for_status().json())
    return f"onebitd's costs at the end: {costs_line(stats.costs)}"


def p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def share(n: int, of: float | None) -> str:
    return "-" if of is None else f"{of:.0%} of {n}"


# -- routes ----------------------------------------------------------------------------------------


def side_settings(side: str, shipped: Any) -> Any:
    """The ``[hybrid]`` settings a side runs with: the shipped ones, or one route forced."""
    if side == "plain":
        return attrs.evolve(shipped, min_prompt_tokens=10**9)
    if side == "file":
        return attrs.evolve(shipped, route_by="length", min_prompt_tokens=1)
    return shipped


async def routes(args: argparse.Namespace) -> int:
    sizes = QUICK_SIZES if args.quick else tuple(int(s) for s in args.sizes.split(",")) if args.sizes else SIZES
    samples = 1 if args.quick else args.samples
    print(machine())
    noise = Noise.start([])
    rng = random.Random(1)
    measured: dict[int, dict[str, list[float]]] = {}
    taken: dict[int, list[str]] = {}
    default_lines: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ob-bench-", dir="/tmp") as tmp:
        slots = max(4, args.streams + 1)  # the shipped 4 slots, or one more than the streams
        config = shipped_config(Path(tmp), ctx_size=SLOT_TOKENS * slots, parallel=slots)
        async with (
            open_lines() as lines,
            run_daemon(config, providers_ready=True, ready_timeout_s=TIMEOUT_S) as running,
            running.clients(request_timeout_s=TIMEOUT_S) as clients,
            trio.open_nursery() as streams,
        ):
            completions = running.daemon.models.default.completions
            shipped = completions.settings
            (provider,) = running.daemon.models.default.parts.providers.all
            print(f"provider: {provider.name}, engine {provider.engine or '-'}, device {provider.device or '-'}")

            async def one(side: str, size: int) -> tuple[Streamed, dict[str, Any]]:
                completions.configure(side_settings(side, shipped))
                text = await text_of(clients.direct, size, rng)
                before = len(lines.lines)
                body = {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0}
                got = await stream_chat(clients.front, body)
                return got, await measured_line(lines, before)

            decoding = [0]  # replies the streams finished
            for n in range(args.streams):
                streams.start_soon(decode, clients, random.Random(100 + n), decoding)
            if args.streams:
                print(f"{args.streams} streams decoding {STREAM_REPLY_TOKENS}-token replies through onebitd")

            for side in SIDES:  # each side's first request pays for warming up: unmeasured
                await one(side, sizes[0])
            for size in sizes:
                measured[size] = {side: [] for side in SIDES}
                taken[size] = []
                for r in range(samples):
                    for side in SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]:
                        got, line = await one(side, size)
                        measured[size][side].append(got.first_ms)
                        if side.startswith("default"):
                            taken[size].append(line["route"])
                            default_lines.append(line)
                            print(f"    {side}: {decided(line)}, first token {got.first_ms:.0f} ms")
                print(
                    f"  {size} tokens: "
                    + ", ".join(f"{s} {statistics.median(v):.0f} ms" for s, v in measured[size].items())
                )
            streams.cancel_scope.cancel()
            print(costs_of(running))
            if args.streams:
                print(f"the streams finished {decoding[0]} replies meanwhile")
    print()
    print("first token, median ms            default / best   default / plain  A/A      default took")
    print("tokens  default  plain    file      of plain, file")
    for size in sizes:
        m = {side: statistics.median(v) for side, v in measured[size].items()}
        best = min(m["plain"], m["file"])
        routes_taken = ", ".join(f"{route} {taken[size].count(route)}" for route in sorted(set(taken[size])))
        print(
            f"{size:>6}  {m['default']:>7.0f}  {m['plain']:>7.0f}  {m['file']:>7.0f}   {m['default'] / best:>6.2f}"
            f"           {m['default'] / m['plain']:>6.2f}      {m['default'] / m['default again']:>5.2f}"
            f"    {routes_taken}"
        )
    write_lines(args.lines, default_lines)
    n, good = within(default_lines)
    print(f"default side's estimates within 1.5x of the actual prefill: {share(n, good)}")
    print(noise.report([]))
    if args.plot:
        series = {side: [(size, ms) for size in sizes for ms in measured[size][side]] for side in SIDES}
        title = "first token against prompt length" + (f", {args.streams} streams decoding" if args.streams else "")
        figures = [plot.XY(title, "prompt tokens", "first token, ms", series)]
        plot.write(args.plot, "scripts/bench routes", figures, quick=args.quick)
    return 0


# -- fleet -----------------------------------------------------------------------------------------


@attrs.frozen
class Ask:
    group: int
    question: str
    max_tokens: int


@attrs.frozen
class Block:
    first_ms: list[float]
    tokens: int
    wall_s: float
    timings: list[dict[str, Any]]  # the decoder's, per request
    asked: list[int]  # each request's place in the block's asks (they finish out of order)


async def run_block(client: httpx.AsyncClient, prefixes: Sequence[str], asks: Sequence[Ask], concurrency: int) -> Block:
    """``asks`` in order, ``concurrency`` at a time; first tokens, tokens out, the block's wall time."""
    first: list[float] = []
    timings: list[dict[str, Any]] = []
    asked: list[int] = []
    tokens = 0
    queue = iter(enumerate(asks))
    start = time.perf_counter()

    async def worker() -> None:
        nonlocal tokens
        for index, ask in queue:
            messages = [{"role": "system", "content": prefixes[ask.group]}, {"role": "user", "content": ask.question}]
            body = {"messages": messages, "max_tokens": ask.max_tokens, "temperature": 0, "ignore_eos": True}
            got = await stream_chat(client, body)
            first.append(got.first_ms)
            timings.append(got.timings)
            asked.append(index)
            tokens += got.tokens

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return Block(first, tokens, time.perf_counter() - start, timings, asked)


async def system_prompts(decoder: httpx.AsyncClient, groups: int, rng: random.Random) -> list[str]:
    """The fleet's ``groups`` system prompts, 600 to 800 tokens each."""
    return [await text_of(decoder, rng.randint(600, 800), rng) for _ in range(groups)]


async def questions(decoder: httpx.AsyncClient, groups: int, n: int, rng: random.Random) -> list[Ask]:
    """``n`` requests: each a system prompt of ``groups``, a new 20 to 50-token question, 32 to 64
    tokens out."""
    return [
        Ask(rng.randrange(groups), await text_of(decoder, rng.randint(20, 50), rng), rng.randint(32, 64))
        for _ in range(n)
    ]


def paired(direct: Block, onebitd: Block) -> float:
    """The median over a block's asks of onebitd's first token less direct's for the same ask: the
    sides' difference with the asks' own spread (cold or cached, short or long) taken out, which
    the ratio of the two medians keeps."""
    theirs = dict(zip(direct.asked, direct.first_ms, strict=True))
    return statistics.median(ms - theirs[ask] for ask, ms in zip(onebitd.asked, onebitd.first_ms, strict=True))


def requests_of(blocks: dict[str, list[Block]]) -> list[dict[str, Any]]:
    """Each side's requests, block by block in the order they finished: the ask, the first token, and
    what the decoder said of its prompt."""
    return [
        {
            "side": side,
            "block": n,
            "ask": index,
            "first_ms": ms,
            **{key: timings.get(key) for key in ("prompt_n", "prompt_ms", "cache_n")},
        }
        for side, done in blocks.items()
        for n, block in enumerate(done)
        for index, ms, timings in zip(block.asked, block.first_ms, block.timings, strict=True)
    ]


async def warm_up(
    args: argparse.Namespace, per_block: int, direct: httpx.AsyncClient, other: httpx.AsyncClient, lines: RouteLines
) -> None:
    """Requests on system prompts of their own before any block is timed (their own draw, so the
    blocks' asks are the same with or without), direct's first, not counted; onebitd's route lines
    (and so its saves after them) waited for, so that none is counted with the blocks.

    Without it direct's first block runs on a freshly started llama-server, whose prompt-cache saves
    are quicker than they are anywhere later in the run (docs/benchmarks.md, "the first blocks'
    memory").  It also teaches onebitd's cost model and fills its prefix store, as any earlier
    traffic would."""
    n = args.warmup if args.warmup is not None else 4 if args.quick else per_block
    if n == 0:
        return
    rng = random.Random(3)
    prefixes = await system_prompts(direct, args.groups, rng)
    asks = await questions(direct, args.groups, n, rng)
    before = len(lines.lines)
    for client in (direct, other):
        await run_block(client, prefixes, asks, args.concurrency)
    if not args.aa:  # a direct side logs none: it bypasses onebitd
        with trio.fail_after(TIMEOUT_S):  # onebitd's process may have died meanwhile
            await lines.wait(before + n)
    print(f"  warm-up: {n} requests a side on system prompts of their own, not counted")


async def fleet(args: argparse.Namespace) -> int:
    per_block = 12 if args.quick else args.requests
    print(machine())
    noise = Noise.start([])
    rng = random.Random(2)
    blocks: dict[str, list[Block]] = {"direct": [], "onebitd": []}
    with tempfile.TemporaryDirectory(prefix="ob-bench-", dir="/tmp") as tmp:
        (Path(tmp) / "a").mkdir()
        (Path(tmp) / "b").mkdir()
        plain = shipped_config(Path(tmp) / "a", hybrid=False)
        mine = shipped_config(Path(tmp) / "b", hybrid=not args.aa)
        mine = attrs.evolve(mine, log=attrs.evolve(mine.log, format="json", level="info"))  # its route lines
        with (Path(tmp) / "onebitd.log").open("w") as log:
            async with (
                run_daemon(plain, ready_timeout_s=TIMEOUT_S) as direct_side,
                direct_side.clients(request_timeout_s=TIMEOUT_S) as direct,
                piped_lines(log) as (pipe, lines),
                # READY=1: its providers started (a provider not ready is the benchmark's error)
                spawn_onebitd(mine, Path(tmp) / "b", pipe, ready_timeout_s=TIMEOUT_S) as onebitd,
            ):
                other = onebitd.direct if args.aa else onebitd.front
                prefixes = await system_prompts(direct.direct, args.groups, rng)
                first = await questions(direct.direct, args.groups, per_block, rng)
                second = await questions(direct.direct, args.groups, per_block, rng)
                await warm_up(args, per_block, direct.direct, other, lines)
                onebitd_lines_from = len(lines.lines)  # the direct side logs none: it bypasses onebitd
                for side, client, block in [
                    ("direct", direct.direct, first),
                    ("onebitd", other, first),
                    ("onebitd", other, second),
                    ("direct", direct.direct, second),
                ]:
                    done = await run_block(client, prefixes, block, args.concurrency)
                    blocks[side].append(done)
                    print(
                        f"  {side}: {len(done.first_ms)} requests,"
                        f" median first token {statistics.median(done.first_ms):.0f} ms"
                    )
                if not args.aa:  # a direct side logs none: it bypasses onebitd
                    with trio.fail_after(TIMEOUT_S):  # onebitd's process may have died meanwhile
                        await lines.wait(onebitd_lines_from + 2 * per_block)
                    print(await spawned_costs(onebitd.front))
                ours = lines.lines[onebitd_lines_from:]
    write_lines(args.lines, ours)
    if args.lines is not None:  # both sides' requests, for a study of where their first tokens part
        write_lines(args.lines.with_suffix(".requests"), requests_of(blocks))
    print()
    for line in ours:
        print(f"    {decided(line)}")
    ttft = {side: [ms for b in bs for ms in b.first_ms] for side, bs in blocks.items()}
    rate = {side: sum(b.tokens for b in bs) / sum(b.wall_s for b in bs) for side, bs in blocks.items()}
    after_restore = sum(1 for line in ours if line["route"] != "plain" and (line.get("restored_tokens") or 0) > 0)
    handed = sum(1 for line in ours if line["route"] != "plain")
    restored = sum(1 for line in ours if (line.get("restored_tokens") or 0) > 0)
    n, good = within(ours)
    print()
    if args.aa:
        print("A/A: the onebitd side is a second llama-server direct; its ratios are the method's noise")
    print(f"{'':<9}first token median  p90     tokens/s")
    for side in ("direct", "onebitd"):
        print(f"{side:<9}{statistics.median(ttft[side]):>10.0f} ms  {p90(ttft[side]):>6.0f} ms  {rate[side]:>7.1f}")
    print(
        f"onebitd / direct: median {statistics.median(ttft['onebitd']) / statistics.median(ttft['direct']):.2f}x,"
        f" p90 {p90(ttft['onebitd']) / p90(ttft['direct']):.2f}x, throughput {rate['onebitd'] / rate['direct']:.2f}x"
    )
    each = zip(("first", "second"), blocks["direct"], blocks["onebitd"], strict=True)
    gaps = ", ".join(f"{which} blocks {paired(d, o):+.0f} ms" for which, d, o in each)
    print(f"onebitd less direct, the same ask, median: {gaps}")
    print(
        f"onebitd's {len(ours)} requests: {handed} handed over, {restored} restored from the prefix store,"
        f" {after_restore} handed over after a restore; estimates within 1.5x: {share(n, good)}"
    )
    print("the decoder's own timings, median per request (llama-server's last chunk):")
    for side in ("direct", "onebitd"):
        pairs = [(ms, t) for b in blocks[side] for ms, t in zip(b.first_ms, b.timings, strict=True) if t]
        if pairs:
            told = [t for _, t in pairs]
            print(
                f"  {side:<9}prompt_n {statistics.median(t.get('prompt_n', 0) for t in told):.0f},"
                f" prompt_ms {statistics.median(t.get('prompt_ms', 0.0) for t in told):.0f},"
                f" cache_n {statistics.median(t.get('cache_n', 0) for t in told):.0f},"
                f" first token less prompt_ms {statistics.median(ms - t.get('prompt_ms', 0.0) for ms, t in pairs):.0f}"
                f" ({len(told)} requests said)"
            )
    print(noise.report([]))
    if args.plot:
        figures = [plot.Bars("first token (ms)", "ms", {"first token": ttft})]
        plot.write(args.plot, "scripts/bench fleet", figures, quick=args.quick)
    return 0
