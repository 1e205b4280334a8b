"""``scripts/bench versus --tree DIR``: onebitd from this tree against onebitd from another checkout
(an older commit, `git worktree add DIR COMMIT`), side by side in one run.

A 2-CPU VM's speed swings by 2x from one minute to the next (the same benchmark's direct latency
went 12 ms, 29 ms, 32 ms in three runs an hour apart, with no other process on the machine), and
onebitd's CPU per request swings with it: two `overhead` runs taken minutes apart cannot say which
tree costs less.  Here both onebitd processes run at once, each with its own decoder (the same
build, model and flags), and every measurement alternates between them, so a swing falls on both.

(a) short completions, alternating tree by tree (which goes first alternates too): latency, and
each onebitd's CPU from /proc over the whole phase, per request; (b) rounds of concurrent streams,
alternating: token rate, first token, each onebitd's CPU per relayed chunk (the phase's CPU, less
its requests at (a)'s cost).  Direct llama-server is
`scripts/bench overhead`'s business; this says only whether a change made onebitd cheaper.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import attrs
import trio

from bench import plot
from bench.rig import (
    ROOT,
    BenchError,
    Noise,
    bench_config,
    decoder_version,
    machine,
    percentile,
    process_cpu_s,
    rss_of,
    spawn_onebitd,
)
from bench.workloads import Side, load_arguments, load_bodies, relay_figures, short_completion, stream_round
from supervisor.config import locate

NAMES = ("this tree", "other tree")


def arguments(parser: argparse.ArgumentParser) -> None:
    """``overhead``'s load (pairs, rounds, streams, ``--quick``), and the other tree."""
    load_arguments(parser, pairs=300, rounds=4)
    parser.add_argument("--tree", type=Path, required=True, help="the other checkout (its scripts/ and supervisor/)")
    parser.add_argument("--threads", type=int, default=0, help="decoder threads (0: llama-server's default)")
    parser.add_argument("--log", type=Path, help="keep both onebitds' logs here (default: discarded)")


def _tree(path: Path) -> Path:
    path = path.resolve()
    if not any((path / "supervisor" / name).is_file() for name in ("daemon.py", "daemon/__init__.py")):
        raise BenchError(f"--tree {path}: no supervisor/daemon there")
    return path


async def _shape(tree: Path) -> dict[str, Any]:
    """The keys the other checkout's config knows (its defaults, unstructured), asked of its own code."""
    script = "import json; from supervisor import config as c; print(json.dumps(c.unstructure(c.loads(''))))"
    done = await trio.run_process([sys.executable, "-c", script], cwd=str(tree), capture_stdout=True)
    shape: dict[str, Any] = json.loads(done.stdout)
    return shape


async def run(args: argparse.Namespace) -> int:
    """Both onebitds in processes of their own (bench/rig.py), measured alternately with
    ``overhead``'s load (bench/workloads.py)."""
    other = _tree(args.tree)
    short, streams = load_bodies(args)
    dirs = [Path(tempfile.mkdtemp(prefix="ob-bench-", dir="/tmp")) for _ in NAMES]
    try:
        log_path = Path(args.log) if args.log else dirs[0] / "onebitd.log"
        with log_path.open("w") as log:
            ctx_size = max(2048, 256 * args.parallel)
            # One llama-server for both sides, named in both configs: left to itself, each checkout's
            # onebitd finds the build its own patches key (an older checkout, an older build), and the
            # two decoders would differ (a portable AVX2 build against this tree's CPU variants).
            binary = locate.llama_server("")
            if binary is None:
                raise BenchError("no llama-server built: run scripts/setup")
            configs = [
                attrs.evolve(config, decoder=attrs.evolve(config.decoder, binary=str(binary)))
                for config in (
                    bench_config(directory, parallel=args.parallel, ctx_size=ctx_size, threads=args.threads)
                    for directory in dirs
                )
            ]
            model = locate.model_path(configs[0].model.path)
            print("onebit versus: onebitd from this tree and from another, side by side, each with its own decoder")
            print(f"this tree: {ROOT}\nother tree: {other}")
            print(f"machine: {machine()}")
            print(f"decoder: {await decoder_version(configs[0])}")
            print(f"model: {model.name if model else '?'}, ctx_size {ctx_size}, parallel {args.parallel}")
            print(
                f"(a) {args.pairs} short completions each, alternating, after {args.warmup} each; "
                f"(b) {args.rounds} rounds each of {args.streams} streams x {args.stream_tokens} tokens"
            )
            async with (
                spawn_onebitd(configs[0], dirs[0], log) as mine,
                spawn_onebitd(configs[1], dirs[1], log, root=other, shape=await _shape(other)) as theirs,
            ):
                spawned = (mine, theirs)
                ours = (*[s.pid for s in spawned], *[s.decoder_pid for s in spawned])
                noise = Noise.start(ours)
                sides = [Side(), Side()]

                def cpus() -> list[float]:
                    return [process_cpu_s(s.pid) for s in spawned]

                # Each onebitd's CPU over the whole phase, not around its own requests: what it does after
                # a reply's last byte (the route line, the next idle period, its decoder's log lines)
                # runs while the other tree's request is on, and is this tree's cost all the same.
                for i in range(args.warmup + args.pairs):
                    if i == args.warmup:
                        before = cpus()
                    for k in (0, 1) if i % 2 == 0 else (1, 0):
                        latency = await short_completion(spawned[k].front, short)
                        if i >= args.warmup:
                            sides[k].latencies.append(latency)
                short_cpu = [after - start for after, start in zip(cpus(), before, strict=True)]
                for k in (0, 1):  # a warm-up round each
                    await stream_round(spawned[k].front, streams, Side())
                before = cpus()
                for r in range(args.rounds):
                    for k in (0, 1) if r % 2 == 0 else (1, 0):
                        await stream_round(spawned[k].front, streams, sides[k])
                stream_cpu = [after - start for after, start in zip(cpus(), before, strict=True)]
                sides = [
                    attrs.evolve(side, short_cpu=short_s, stream_cpu=stream_s)
                    for side, short_s, stream_s in zip(sides, short_cpu, stream_cpu, strict=True)
                ]
                rss = [rss_of(s.pid) for s in spawned]
                print()
                _report(sides, args)
                print(f"rss after: this tree {rss[0]:.1f} MiB, other tree {rss[1]:.1f} MiB")
                print(noise.report(ours))
                if args.plot:
                    figures = relay_figures(dict(zip(NAMES, sides, strict=True)))
                    plot.write(args.plot, "scripts/bench versus", figures, quick=args.quick)
    finally:  # a run cut short (Ctrl-C, SIGTERM) leaves nothing behind either
        for directory in dirs:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


def _report(sides: list[Any], args: argparse.Namespace) -> None:
    def per_request(side: Any) -> float:
        return float(side.short_cpu / len(side.latencies) * 1000)

    def per_chunk(side: Any) -> float:
        # The stream rounds' requests, at the short requests' cost, out first.
        requests = args.streams * args.rounds
        cpu = side.stream_cpu - per_request(side) / 1000 * requests
        return float(cpu / side.events * 1e6) if side.events else 0.0

    rows = [
        ("(a) latency median, ms", *(statistics.median(s.latencies) * 1000 for s in sides)),
        ("(a) latency p99, ms", *(percentile(s.latencies, 99) * 1000 for s in sides)),
        ("(a) onebitd cpu per request, ms", *(per_request(s) for s in sides)),
        ("(b) aggregate tokens/s", *(s.token_rate for s in sides)),
        ("(b) first token median, ms", *(statistics.median(s.first_tokens) * 1000 for s in sides)),
        ("(b) onebitd cpu per chunk, us", *(per_chunk(s) for s in sides)),
    ]
    print(f"{'measure':34}{'this tree':>12}{'other tree':>12}{'this/other':>12}")
    for name, mine, theirs in rows:
        print(f"{name:34}{mine:12.2f}{theirs:12.2f}{mine / theirs if theirs else float('nan'):12.3f}")
    print(f"(b) chunks relayed: this tree {sides[0].events}, other tree {sides[1].events}")
