"""onebit's benchmarks: what onebitd costs on top of the llama-server it supervises.

    scripts/bench overhead [--quick]   latency and token rate: through onebitd vs straight to llama-server
    scripts/bench handoff [--quick]    the file route vs the plain route, and decode isolation
    scripts/bench providers [--quick]  first token: plain vs the file route on a ggml and an OpenVINO provider
    scripts/bench multiturn [--quick]  chats over many turns: plain, hybrid, llama-server direct
    scripts/bench prefix [--quick]     a long shared prompt across a decoder crash, with and without the store
    scripts/bench models [--quick]     two models through a one-model budget: swaps, with and without the store
    scripts/bench families [--quick]   per model family and quant: first token plain vs the file route, memory
    scripts/bench turns [--quick]      per family, an agent's session across a swap and a restart: onebitd
                                       against llama-server direct
    scripts/bench agent [--quick]      an agent's session through anthropic-python and openai-python's Responses
                                       client: direct, plain, hybrid, and after a full restart
    scripts/bench hosts [--quick]      agents' sessions over three hosts behind HAProxy, one drained half way:
                                       affinity by conversation against the round-robin it replaced
    scripts/bench routes [--quick]     first token, 256 to 7,600 tokens: the shipped config's choice against
                                       plain and the file route forced, sides rotating, an A/A pair
    scripts/bench fleet [--quick]      an agent fleet's shared-prefix workload: onebitd against llama-server direct

Each also takes ``--plot FILE.svg``: its figures drawn as one picture as well (bench/plot.py).

Every subcommand runs onebitd (port 0, a runtime directory under /tmp), waits until its decoder is
ready, measures, then stops the daemon, which stops and reaps its children, whatever happened (an
error, Ctrl-C, SIGTERM).  ``overhead`` runs it in a process of its own, as in service (``--onebitd
inline`` puts it in this one, beside the clients); the others run it in this process.  Figures are
ratios against the same llama-server reached directly in the same run, so that the machine's speed,
and most of its noise, cancels out; nothing here passes or fails on speed.  Exit status: 0 when
every request succeeded, 1 otherwise, 2 for a set-up problem.

Adding a subcommand: write an ``arguments(parser)`` function and an ``async run(args) -> int``
coroutine (use supervisor/testing.py's ``run_daemon`` and ``Running.clients`` for the daemon and its
two clients) that, given ``--plot``, hands its samples to ``plot.write`` as panels, in a module of
its own under bench/ that imports only rig.py, workloads.py and plot.py (tests/unit/repo/test_imports.py holds
that), and add one :class:`Subcommand` line to ``SUBCOMMANDS`` below.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence

import attrs
import trio

from bench import (
    agent,
    families,
    handoff,
    hosts,
    models,
    multiturn,
    overhead,
    plot,
    prefix,
    providers,
    routes,
    turns,
    versus,
)
from bench.rig import BenchError, leaves
from supervisor.errors import ChildError, ConfigError


@attrs.frozen
class Subcommand:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], Awaitable[int]]


SUBCOMMANDS = [
    Subcommand(
        name="overhead",
        help="latency and token rate through onebitd vs straight to llama-server",
        arguments=overhead.arguments,
        run=overhead.run,
    ),
    Subcommand(
        name="handoff",
        help="the file route against the plain route: prefill, save, restore, first byte, decode isolation",
        arguments=handoff.arguments,
        run=handoff.run,
    ),
    Subcommand(
        name="providers",
        help="first token: plain against the file route with a ggml and with an OpenVINO provider",
        arguments=providers.arguments,
        run=providers.run,
    ),
    Subcommand(
        name="families",
        help="per model family and quant: first token plain against the file route, the restore, memory",
        arguments=families.arguments,
        run=families.run,
    ),
    Subcommand(
        name="turns",
        help="per family, an agent's session of 8 turns across a swap and a restart: onebitd against direct",
        arguments=turns.arguments,
        run=turns.run,
    ),
    Subcommand(
        name="multiturn",
        help="chats re-sending their conversation every turn: plain, hybrid and llama-server direct",
        arguments=multiturn.arguments,
        run=multiturn.run,
    ),
    Subcommand(
        name="prefix",
        help="a long shared prompt across a decoder crash, with the prefix store and without",
        arguments=prefix.arguments,
        run=prefix.run,
    ),
    Subcommand(
        name="agent",
        help="an agent's session through anthropic-python and the Responses client: direct, plain, hybrid, restarted",
        arguments=agent.arguments,
        run=agent.run,
    ),
    Subcommand(
        name="models",
        help="two models through max_loaded = 1: swapped-back turns with the prefix store and without, a burst",
        arguments=models.arguments,
        run=models.run,
    ),
    Subcommand(
        name="hosts",
        help="agents' sessions over three hosts behind HAProxy, one drained: affinity against round-robin",
        arguments=hosts.arguments,
        run=hosts.run,
    ),
    Subcommand(
        name="routes",
        help="first token from 256 to 7,600 tokens: the shipped config's route against plain and file forced, A/A",
        arguments=routes.routes_arguments,
        run=routes.routes,
    ),
    Subcommand(
        name="fleet",
        help="an agent fleet's shared-prefix workload, two at a time: onebitd against llama-server direct, ABBA",
        arguments=routes.fleet_arguments,
        run=routes.fleet,
    ),
    Subcommand(
        name="versus",
        help="onebitd from this tree against onebitd from another checkout, side by side: CPU and latency",
        arguments=versus.arguments,
        run=versus.run,
    ),
]


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="scripts/bench", description=(__doc__ or "").split("\n\n")[0])
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in SUBCOMMANDS:
        sub = commands.add_parser(command.name, help=command.help, description=command.help)
        command.arguments(sub)
        plot.add_argument(sub)
        sub.set_defaults(subcommand=command)
    return top


async def run(args: argparse.Namespace) -> int:
    """The chosen subcommand, cut short by SIGTERM as by Ctrl-C: the daemon still stops and reaps."""
    subcommand: Subcommand = args.subcommand
    status = 143  # 128 + SIGTERM, unless the subcommand finishes
    async with trio.open_nursery() as nursery:

        async def on_sigterm() -> None:
            with trio.open_signal_receiver(signal.SIGTERM) as signals:
                async for _ in signals:
                    print("scripts/bench: SIGTERM: stopping", file=sys.stderr)
                    nursery.cancel_scope.cancel()

        nursery.start_soon(on_sigterm)
        started = time.time()
        status = await subcommand.run(args)
        nursery.cancel_scope.cancel()
    # A picture from an earlier run does not count (its mtime is before this one's start; 1 s for
    # file systems that keep whole seconds).
    if args.plot and not (args.plot.is_file() and args.plot.stat().st_mtime >= started - 1):
        raise BenchError(f"{subcommand.name} drew no picture at {args.plot}: its run() does not pass --plot on")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.plot:
        try:
            plot.check()  # now, not after a run of minutes
        except plot.PlotError as problem:
            print(f"scripts/bench: {problem}", file=sys.stderr)
            return 2
    status = 1
    # The subcommand runs inside nurseries: what it raises arrives as an exception group.
    try:
        status = trio.run(run, args)
    except* ConfigError as group:
        for exc in leaves(group):
            for line in exc.lines if isinstance(exc, ConfigError) else [str(exc)]:
                print(f"scripts/bench: {line}", file=sys.stderr)
        status = 2
    except* (BenchError, ChildError) as group:  # ChildError: the decoder failed to start
        for exc in leaves(group):
            print(f"scripts/bench: {exc}", file=sys.stderr)
        status = 1
    except* KeyboardInterrupt:
        status = 130
    return status
