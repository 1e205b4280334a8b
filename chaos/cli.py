"""onebit's chaos suite: faults on the real parts, and proof that nothing is lost (docs/reliability.md).

    scripts/chaos [--quick] [--only NAME ...] [--time-limit S]    scripts/chaos --list

Every scenario runs onebitd in this process (port 0, a runtime directory under /tmp) with the real
llama-server as its decoder, and where it needs one a real provider (a llama-server provider, or
tests/rigs/llama_exec_provider.py / tests/rigs/llama_worker_provider.py for the exec and worker kinds); it sends
a bounded number of requests, injects its fault, and prints one line:

    requests sent, answered correctly, answered with a clean error, lost, left behind

* correct: a 200 whose reply is whole (a streamed one ends with ``[DONE]``) with the tokens asked for;
* a clean error: an HTTP error in onebitd's or llama-server's JSON envelope (a 503 with Retry-After),
  or a stream that ends with an SSE ``error`` event;
* lost: no answer within the scenario's bound, or a connection that hangs;
* left behind: processes under onebitd beyond its decoder and providers, files in ``<runtime>/state``,
  stray sockets in the runtime directory, onebitd's open fds beyond the tolerance, and (after the
  daemon stopped) any process it started that is not reaped.

A lost request, a leftover, or a reply that is neither right nor a clean error fails the scenario,
and so does a scenario that sent no request at all.  One that cannot run on this machine
(``disk-full`` without the permission to mount) says ``skip`` and why, never ``ok``.  Exit status 1
when any scenario failed (a skip is no failure), 2 for a set-up problem.  Signals go only to the
pids of the decoder and providers this process's onebitd started, and every SIGSTOP is undone in a
``finally``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import trio

from chaos.clients import burst, fuzz, hang_ups, slow_readers
from chaos.decoder import cancelled_prefill, decoder_hang, decoder_kill
from chaos.providers import provider_fault
from chaos.resources import disk_full, soak
from chaos.rig import ChaosError, Run, Scenario, Skipped, fds
from chaos.traffic import Tally
from supervisor.config import locate

SCENARIOS: dict[str, Scenario] = {
    "decoder-hang": decoder_hang,
    "decoder-kill": decoder_kill,
    "provider-llama-server": provider_fault("llama-server"),
    "provider-exec": provider_fault("exec"),
    "provider-worker": provider_fault("worker"),
    "disk-full": disk_full,
    "hang-ups": hang_ups,
    "slow-readers": slow_readers,
    "burst": burst,
    "cancelled-prefill": cancelled_prefill,
    "soak": soak,
    "fuzz": fuzz,
}


def report(name: str, tally: Tally, seconds: float) -> None:
    verdict = "FAIL" if tally.failed else "skip" if tally.skipped else "ok"
    print(
        f"{name:<22} {verdict:<4} sent {tally.sent:>4}  correct {tally.ok:>4}  clean error {tally.clean:>3}  "
        f"lost {tally.lost}  bad {tally.bad}  hung up {tally.hung_up:>3}  left behind {len(tally.leftovers)}  "
        f"({seconds:.0f}s)"
    )
    if tally.skipped:
        print(f"    skipped: {tally.skipped}")
    for key, value in tally.figures.items():
        print(f"    {key}: {value}")
    for note in tally.notes + [f"left behind: {x}" for x in tally.leftovers]:
        print(f"    {note}")
    sys.stdout.flush()


async def main_async(args: argparse.Namespace) -> int:
    names = args.only or list(SCENARIOS)
    base = Path(tempfile.mkdtemp(prefix="ob-chaos-", dir="/tmp"))
    failed = False
    try:
        run = Run(args.quick, base)
        for name in names:
            tally = Tally()
            started = time.monotonic()
            fd_start = fds()
            with trio.move_on_after(args.time_limit) as limit:
                try:
                    await SCENARIOS[name](run, tally)
                    if not tally.sent:
                        tally.notes.append("failed: the scenario sent no request")
                except Skipped as exc:
                    tally.skipped = str(exc)
                except Exception as exc:  # a scenario's own bug or a broken guarantee: reported, not raised
                    tally.notes.append(f"failed: {type(exc).__name__}: {exc!r}"[:2000])
                    traceback.print_exception(exc, file=sys.stderr)  # where it came from, in full
            if limit.cancelled_caught:
                tally.notes.append(f"failed: over the time limit of {args.time_limit:g}s")
            if fds() > fd_start + 2:
                tally.leftovers.append(f"fds: {fd_start} before the scenario, {fds()} after onebitd stopped")
            report(name, tally, time.monotonic() - started)
            failed |= tally.failed
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the short form (the test suite's)")
    parser.add_argument("--only", action="append", choices=sorted(SCENARIOS), help="this scenario (repeatable)")
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds per scenario (default 900)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--log", default=os.environ.get("CHAOS_LOG", ""), help="onebitd's log goes here")
    args = parser.parse_args()
    if args.list:
        for name, scenario in SCENARIOS.items():
            print(f"{name:<22} {(scenario.__doc__ or '').strip().splitlines()[0]}")
        return 0
    if locate.llama_server("") is None:
        print("scripts/chaos: no llama-server; run scripts/setup", file=sys.stderr)
        return 2
    logging.basicConfig(filename=args.log or os.devnull, level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        return trio.run(main_async, args)
    except ChaosError as exc:
        print(f"scripts/chaos: {exc}", file=sys.stderr)
        return 2
