"""``scripts/bench providers``: the first token on the plain route, the file route with a ggml provider
and the file route with an OpenVINO provider, side by side in one run.

Two daemons at once, each a decoder on one core and one provider on the other (``cpu_affinity``):
one with the ggml provider (the decoder's own engine), one with the OpenVINO one (device CPU unless
``--device``).  Per prompt size (about 256, 1024, 2048 and 3072 tokens), a fresh prompt per sample
(no cache helps anyone), the same prompt on every side: the first streamed token straight from the
ggml daemon's decoder with ``cache_prompt`` off (plain: the decoder prefills), and through each
onebitd (the file route: tokenize, the provider's prefill, save, restore, the decoder's one token).
The three sides take turns in every order (the six permutations in rotation: each side goes first,
second and last alike), after one unmeasured warm-up sample per size; the medians and spreads of
``--samples`` (6) per cell.  ``--aa`` makes every side plain (straight to the ggml decoder, then to
the OpenVINO daemon's decoder, which is the same build): the ratios then show what the method
itself favours.  Then a running stream's longest gap between two tokens while a 2k-token prompt
arrives, plain against each file route; each provider's start (to its READY, and again on its
compile cache), its RSS after the run and its peak; the fidelity verdict over 34 prompts.  Ratios
are plain over file: above 1 is a sooner first token.

Nothing here passes or fails on speed; a missing OpenVINO llama-server is a set-up problem (exit 2).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from bench import plot
from bench.rig import Noise, Rig, machine, open_rig, provider_of
from bench.workloads import fidelity_of, first_tokens, longest_gap
from supervisor import config as configuration
from supervisor.config import Config
from supervisor.errors import ConfigError
from supervisor.llama import openvino
from supervisor.providers.llama import LlamaServerProvider
from supervisor.routes import fidelity

ROOT = Path(__file__).resolve().parent.parent

SIZES = (256, 1024, 2048, 3072)
# The sides; their six orders go in rotation (first_tokens): after six samples each side went first,
# second and last twice, so a side that gains from going after another (a warm cache line, a clock
# that rose) gains on every side alike.
SIDES = ("plain", "ggml", "openvino")


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=6, help="measured samples per size and side (6)")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="prompt sizes, tokens")
    parser.add_argument("--gaps", type=int, default=3, help="inter-token gap rounds per engine (3)")
    parser.add_argument("--device", default="CPU", help="the OpenVINO provider's device (CPU)")
    parser.add_argument("--aa", action="store_true", help="A/A: every side plain, to show what the method favours")
    parser.add_argument("--quick", action="store_true", help="one sample, 256 and 1024 tokens, no fidelity")


def engine_config(runtime_dir: Path, engine: str, device: str, compile_dir: Path) -> Config:
    cpus = sorted(os.sched_getaffinity(0))
    decoder_cpus, provider_cpus = ([cpus[0]], [cpus[1]]) if len(cpus) >= 2 else (cpus, cpus)
    data = configuration.unstructure(Config())
    data["server"].update(port=0, runtime_dir=str(runtime_dir), shutdown_grace_s=10.0)
    data["cache"].update(dir=str(runtime_dir / "prefix"), compile_dir=str(compile_dir))
    # Two slots of 4096 tokens: a 3072-token prompt and its reply fit one.
    data["model"].update(parallel=2, ctx_size=8192)
    data["decoder"].update(threads=len(decoder_cpus), cpu_affinity=decoder_cpus)
    # Every prompt of the sizes goes to the provider: the first token is what is measured.
    data["hybrid"].update(enabled=True, min_prompt_tokens=64, route_by="length")
    provider: dict[str, Any] = {
        "kind": "llama-server",
        "name": engine,
        "threads": len(provider_cpus),
        "cpu_affinity": provider_cpus,
    }
    if engine == "openvino":
        provider.update(engine="openvino", device=device)
    data["provider"] = [provider]
    config = configuration.structure(data, "bench")
    configuration.check(config, "bench")
    return config


def memory_kib(pid: int | None) -> tuple[int, int]:
    """VmRSS and VmHWM (the peak) of a process, in KiB."""
    if pid is None:
        return 0, 0
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields.get("VmRSS", 0), fields.get("VmHWM", 0)


@contextlib.asynccontextmanager
async def engine_rig(engine: str, device: str, compile_dir: Path) -> AsyncIterator[tuple[Rig, float]]:
    """One engine's daemon, and its provider's start: from the daemon's (the device listing
    included) to the provider's READY."""
    with tempfile.TemporaryDirectory(prefix="ob-bench-", dir="/tmp") as tmp:
        config = engine_config(Path(tmp), engine, device, compile_dir)
        started = time.time()
        # The start-time check is left out: the run measures fidelity itself, over 34 prompts, and
        # reports an engine over the bound rather than refusing to time it.
        async with open_rig(config, check_fidelity=False) as rig:
            provider = provider_of(rig)
            yield rig, provider.child.statistics().state_since - started


async def measure(args: argparse.Namespace, chosen: Sequence[int], compile_dir: Path) -> dict[str, Any]:
    """Both daemons up at once; the first tokens side by side; each engine's gaps, start, memory
    and fidelity."""

    samples = 1 if args.quick else args.samples
    async with (
        engine_rig("ggml", args.device, compile_dir) as (ggml, ggml_start),
        engine_rig("openvino", args.device, compile_dir) as (ov, ov_start),
    ):
        rigs = {"ggml": ggml, "openvino": ov}
        noise = Noise.start([])
        rows = await first_tokens(rigs, samples, chosen, args.aa)
        at = time.monotonic()
        check = await fidelity_of(ov, provider_of(ov), fidelity.START_PROMPTS)
        check_s = time.monotonic() - at
        engines: dict[str, dict[str, Any]] = {}
        stream_tokens = 64 if args.quick else 160
        for engine, rig in rigs.items():
            gaps: dict[str, list[float]] = {"plain": [], "file route": []}
            for r in range(1 if args.quick else args.gaps):
                for plain in (True, False) if r % 2 == 0 else (False, True):
                    front = rig.decoder if plain else rig.front
                    gaps["plain" if plain else "file route"].append(
                        await longest_gap(rig, rig.decoder, front, plain, stream_tokens, r)
                    )
            provider = provider_of(rig)
            # The verdict is of the file route, which an A/A run does not time.
            verdict = None if args.quick or args.aa else await fidelity_of(rig, provider, fidelity.prompt_set(34))
            rss, peak = memory_kib(provider.child.pid)
            decoder_rss, _ = memory_kib(rig.daemon.models.default.decoder.pid)
            engines[engine] = {
                "engine": engine,
                "device": provider.device,
                "gaps": gaps,
                "start_s": ggml_start if engine == "ggml" else ov_start,
                "check_s": None if engine == "ggml" else check_s,
                "check": None if engine == "ggml" else check,
                "rss_mib": rss / 1024,
                "peak_mib": peak / 1024,
                "decoder_rss_mib": decoder_rss / 1024,
                "verdict": verdict,
            }
        noise_line = noise.report([])
    return {"rows": rows, "engines": engines, "noise": noise_line}


async def start_again(device: str, compile_dir: Path) -> float:
    """An OpenVINO provider's start once its compile cache holds what the first start compiled."""
    with tempfile.TemporaryDirectory(prefix="ob-bench-", dir="/tmp") as tmp:
        config = engine_config(Path(tmp), "openvino", device, compile_dir)
        started = time.time()
        async with open_rig(config, check_fidelity=False) as rig:
            (provider,) = rig.daemon.models.default.parts.providers.all
            assert isinstance(provider, LlamaServerProvider)
            return provider.child.statistics().state_since - started


async def run(args: argparse.Namespace) -> int:
    if openvino.llama_server("") is None:
        raise ConfigError(
            [f"bench providers: no OpenVINO llama-server (set {openvino.BINARY_ENV}, or run scripts/setup)"]
        )

    chosen = (256, 1024) if args.quick else tuple(args.sizes)
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="ob-bench-ov-", dir="/tmp") as compiled:
        measured = await measure(args, chosen, Path(compiled))
        again_s = await start_again(args.device, Path(compiled))
    rows, engines = measured["rows"], measured["engines"]
    report(args, chosen, rows, engines)
    print(f"  openvino started again on its compile cache: {again_s:.1f} s")
    for r in engines.values():
        if r["verdict"] is not None:
            within = "within" if r["verdict"].ok else "OVER"
            print(f"fidelity, {r['engine']}: {r['verdict'].summary()}; {within} the bound")
    print(measured["noise"])
    if args.plot:
        plot.write(args.plot, "scripts/bench providers", provider_figures(rows, engines), quick=args.quick)
    return 0


def spread(values: Sequence[float]) -> str:
    return f"{min(values):.0f}-{max(values):.0f}"


def report(
    args: argparse.Namespace, chosen: Sequence[int], rows: dict[int, dict[str, Any]], engines: dict[str, Any]
) -> None:
    samples = len(rows[chosen[0]]["plain"])
    ov = engines["openvino"]["device"]
    what = "A/A: every side plain, straight to a decoder" if args.aa else "plain: the decoder direct; file routes"
    print()
    print(f"first streamed token, ms: median (spread) of {samples} sample(s) per cell after 1 warm-up,")
    print(f"the same fresh prompt on every side, the sides in rotating order; {what}")
    print("ratio: plain / side (above 1: the side's first token sooner)")
    print(
        f"{'tokens':>6}  {'plain':>7} {'spread':>11}  {'ggml':>7} {'spread':>11}  {'openvino-' + ov:>12} {'spread':>11}"
        f"  {'plain/ggml':>10}  {'plain/openvino':>14}  prompt_n ggml openvino"
    )
    for size in chosen:
        row = rows[size]
        plain, g, o = (statistics.median(row[side]) for side in SIDES)
        n = row["decoder_prompt_n"]
        print(
            f"{row['tokens']:>6}  {plain:>7.0f} {spread(row['plain']):>11}  {g:>7.0f} {spread(row['ggml']):>11}"
            f"  {o:>12.0f} {spread(row['openvino']):>11}  {plain / g:>9.2f}x  {plain / o:>13.2f}x"
            f"  {n['ggml']:>13} {n['openvino']:>8}"
        )
    print()
    print("a stream's longest inter-token gap while a 2k-token prompt arrives, ms (median)")
    for r in engines.values():
        gaps = r["gaps"]
        print(
            f"  {r['engine']:<9} plain {statistics.median(gaps['plain']):>8.1f}"
            f"   file route {statistics.median(gaps['file route']):>8.1f}"
        )
    print()
    print("providers: start (from the daemon's to the provider's READY), memory after the run")
    for r in engines.values():
        check = f"  start-time check {r['check_s']:.1f} s" if r["check_s"] is not None else ""
        print(
            f"  {r['engine']:<9} device {r['device']:<4} start {r['start_s']:>5.1f} s{check}"
            f"  rss {r['rss_mib']:>6.0f} MiB (peak {r['peak_mib']:.0f})  decoder rss {r['decoder_rss_mib']:.0f} MiB"
        )


def provider_figures(rows: dict[int, dict[str, Any]], engines: dict[str, Any]) -> list[plot.Panel]:
    """First token against prompt length, plain and the file route on each engine, every sample;
    the longest inter-token gap per engine."""
    ov = f"openvino-{engines['openvino']['device']}"
    names = {"plain": "plain", "ggml": "file route, ggml", "openvino": f"file route, {ov}"}
    first = {names[side]: [(row["tokens"], ms) for row in rows.values() for ms in row[side]] for side in SIDES}
    return [
        plot.XY("first streamed token against prompt length", "prompt tokens", "first token, ms", first),
        plot.Bars(
            "a stream's longest gap while a 2k-token prompt arrives",
            "ms",
            {r["engine"]: r["gaps"] for r in engines.values()},
            log_y=True,
        ),
    ]
