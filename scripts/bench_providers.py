"""``scripts/bench providers``: the first token on the plain route, the file route with a ggml provider
and the file route with an OpenVINO provider, side by side in one run.

Two daemons in turn, each a decoder on one core and one provider on the other (``cpu_affinity``):
the ggml provider (the decoder's own engine), then the OpenVINO one (device CPU unless
``--device``).  Per prompt size (about 256, 1024, 2048 and 3072 tokens), a fresh prompt each time (no
cache helps anyone): the first streamed token straight from the decoder with ``cache_prompt`` off
(plain: the decoder prefills), and through onebitd (the file route: tokenize, the provider's
prefill, save, restore, the decoder's one token).  Then a running stream's longest gap between two
tokens while a 2k-token prompt arrives, plain against each file route; each provider's start (to
its READY, and again on its compile cache; the start-time fidelity check's cost), its RSS after the
run and its peak; the fidelity verdict over 34 prompts.  Ratios are plain over file: above 1 is a
sooner first token.

Nothing here passes or fails on speed; a missing OpenVINO llama-server is a set-up problem (exit 2).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bench_handoff  # noqa: E402
import bench_plot  # noqa: E402
from bench_handoff import Rig, first_byte_ms, longest_gap, open_rig, prompt_of  # noqa: E402

from supervisor import config as configuration  # noqa: E402
from supervisor.config import Config  # noqa: E402
from supervisor.errors import ConfigError  # noqa: E402
from supervisor.llama import openvino  # noqa: E402
from supervisor.providers.llama import LlamaServerProvider  # noqa: E402
from supervisor.routes import fidelity  # noqa: E402

SIZES = (256, 1024, 2048, 3072)


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=2, help="fresh prompts per size and route (2)")
    parser.add_argument("--device", default="CPU", help="the OpenVINO provider's device (CPU)")
    parser.add_argument("--quick", action="store_true", help="one round, 256 and 1024 tokens, no fidelity")


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


async def first_tokens(rig: Rig, rounds: int, chosen: tuple[int, ...], salt: int) -> dict[int, dict[str, Any]]:
    rows: dict[int, dict[str, Any]] = {}
    for size in chosen:
        plain: list[float] = []
        hybrid: list[float] = []
        decoder_n: list[int] = []
        count = 0
        for r in range(rounds):
            prompt, count = await prompt_of(rig.decoder, size, salt=salt + size * 100 + r)
            body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "stream": True}
            ms, _ = await first_byte_ms(rig.decoder, "/completion", {**body, "cache_prompt": False, "id_slot": 1})
            plain.append(ms)
            other, _ = await prompt_of(rig.decoder, size, salt=salt + size * 100 + r + 50)
            ms, timings = await first_byte_ms(rig.front, "/completion", {**body, "prompt": other})
            hybrid.append(ms)
            decoder_n.append(timings["prompt_n"])
        rows[size] = {
            "tokens": count,
            "plain_ms": statistics.median(plain),
            "file_ms": statistics.median(hybrid),
            "decoder_prompt_n": max(decoder_n),
            "plain": plain,
            "file": hybrid,
        }
    return rows


async def measure(
    engine: str, device: str, rounds: int, chosen: tuple[int, ...], quick: bool, compile_dir: Path
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ob-bench-", dir="/tmp") as tmp:
        config = engine_config(Path(tmp), engine, device, compile_dir)
        started = time.time()
        # The start-time check is left out: the run measures fidelity itself, over 34 prompts, and
        # reports an engine over the bound rather than refusing to time it.
        async with open_rig(config, check_fidelity=False) as rig:
            (provider,) = rig.daemon.models.default.parts.providers.all
            assert isinstance(provider, LlamaServerProvider)
            # The provider's start: from the daemon's (the device listing included) to its READY.
            start_s = provider.child.statistics().state_since - started
            check = None
            if engine != "ggml":
                at = time.monotonic()
                await fidelity_of(rig, provider, fidelity.START_PROMPTS)
                check = time.monotonic() - at
            rows = await first_tokens(rig, rounds, chosen, salt=1000 if engine == "ggml" else 5000)
            gaps_plain, gaps_file = [], []
            stream_tokens = 64 if quick else 160
            for _ in range(rounds):
                gaps_plain.append(await longest_gap(rig, rig.decoder, rig.decoder, True, stream_tokens))
                gaps_file.append(await longest_gap(rig, rig.decoder, rig.front, False, stream_tokens))
            verdict = None if quick else await fidelity_of(rig, provider, fidelity.prompt_set(34))
            rss, peak = memory_kib(provider.child.pid)
            decoder_rss, _ = memory_kib(rig.daemon.models.default.decoder.pid)
    return {
        "engine": engine,
        "device": provider.device,
        "rows": rows,
        "gap_plain_ms": statistics.median(gaps_plain),
        "gap_file_ms": statistics.median(gaps_file),
        "gaps": {"plain": gaps_plain, "file route": gaps_file},
        "start_s": start_s,
        "check_s": check,
        "rss_mib": rss / 1024,
        "peak_mib": peak / 1024,
        "decoder_rss_mib": decoder_rss / 1024,
        "verdict": verdict,
    }


async def start_again(device: str, compile_dir: Path) -> float:
    """An OpenVINO provider's start once its compile cache holds what the first start compiled."""
    with tempfile.TemporaryDirectory(prefix="ob-bench-", dir="/tmp") as tmp:
        config = engine_config(Path(tmp), "openvino", device, compile_dir)
        started = time.time()
        async with open_rig(config, check_fidelity=False) as rig:
            (provider,) = rig.daemon.models.default.parts.providers.all
            assert isinstance(provider, LlamaServerProvider)
            return provider.child.statistics().state_since - started


async def fidelity_of(rig: Rig, provider: LlamaServerProvider, texts: Sequence[str]) -> fidelity.Verdict:
    hybrid = rig.daemon.models.default.parts.hybrid
    assert hybrid is not None
    probe = fidelity.Probe(
        client=rig.daemon.models.default.client, handoff=hybrid.file, timeout_s=bench_handoff.TIMEOUT_S
    )
    samples = []
    async with rig.daemon.models.default.parts.slots.hold() as slot:
        for i, text in enumerate(texts):
            samples.append(await probe.sample(provider, slot, await probe.tokens(text), req=f"bench-fidelity-{i}"))
        rig.daemon.models.default.parts.slots.forget(slot)
    return fidelity.judge(samples)


async def run(args: argparse.Namespace) -> int:
    if openvino.llama_server("") is None:
        raise ConfigError(
            [f"bench providers: no OpenVINO llama-server (set {openvino.BINARY_ENV}, or run scripts/setup)"]
        )
    chosen = (256, 1024) if args.quick else SIZES
    rounds = 1 if args.quick else args.rounds
    with tempfile.TemporaryDirectory(prefix="ob-bench-ov-", dir="/tmp") as compiled:
        results = [
            await measure(engine, args.device, rounds, chosen, args.quick, Path(compiled))
            for engine in ("ggml", "openvino")
        ]
        again_s = await start_again(args.device, Path(compiled))
    ggml, ov = results
    print()
    print("first streamed token, ms (median of fresh prompts); ratio: plain / file route (above 1: sooner)")
    print("prompt   plain    file route  file route   plain/ggml  plain/openvino  decoder prompt_n")
    print(f"tokens   (ggml)   ggml        openvino-{ov['device']:<4}                              ggml  openvino")
    for size in chosen:
        g, o = ggml["rows"][size], ov["rows"][size]
        print(
            f"{g['tokens']:>6}  {g['plain_ms']:>7.0f}  {g['file_ms']:>9.0f}  {o['file_ms']:>10.0f}"
            f"   {g['plain_ms'] / g['file_ms']:>9.2f}x  {o['plain_ms'] / o['file_ms']:>13.2f}x"
            f"  {g['decoder_prompt_n']:>5} {o['decoder_prompt_n']:>8}"
        )
    print(
        "(plain measured again beside the OpenVINO daemon: "
        + ", ".join(f"{ov['rows'][size]['tokens']}: {ov['rows'][size]['plain_ms']:.0f} ms" for size in chosen)
        + ")"
    )
    print()
    print("a stream's longest inter-token gap while a 2k-token prompt arrives, ms")
    for r in results:
        print(f"  {r['engine']:<9} plain {r['gap_plain_ms']:>8.1f}   file route {r['gap_file_ms']:>8.1f}")
    print()
    print("providers: start (from the daemon's to the provider's READY), memory after the run")
    for r in results:
        check = f"  start-time check {r['check_s']:.1f} s" if r["check_s"] is not None else ""
        print(
            f"  {r['engine']:<9} device {r['device']:<4} start {r['start_s']:>5.1f} s{check}"
            f"  rss {r['rss_mib']:>6.0f} MiB (peak {r['peak_mib']:.0f})  decoder rss {r['decoder_rss_mib']:.0f} MiB"
        )
    print(f"  openvino started again on its compile cache: {again_s:.1f} s")
    for r in results:
        if r["verdict"] is not None:
            within = "within" if r["verdict"].ok else "OVER"
            print(f"fidelity, {r['engine']}: {r['verdict'].summary()}; {within} the bound")
    if args.plot:
        bench_plot.write(args.plot, "scripts/bench providers", provider_figures(results), quick=args.quick)
    return 0


def provider_figures(results: list[dict[str, Any]]) -> list[bench_plot.Panel]:
    """First token against prompt length, plain and the file route on each engine (plain measured
    beside each engine's daemon); the longest inter-token gap per engine."""
    first: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        engine = r["engine"] if r["engine"] == "ggml" else f"{r['engine']}-{r['device']}"
        first[f"plain (beside {engine})"] = [(row["tokens"], ms) for row in r["rows"].values() for ms in row["plain"]]
        first[f"file route, {engine}"] = [(row["tokens"], ms) for row in r["rows"].values() for ms in row["file"]]
    return [
        bench_plot.XY("first streamed token against prompt length", "prompt tokens", "first token, ms", first),
        bench_plot.Bars(
            "a stream's longest gap while a 2k-token prompt arrives",
            "ms",
            {r["engine"]: r["gaps"] for r in results},
            log_y=True,
        ),
    ]
