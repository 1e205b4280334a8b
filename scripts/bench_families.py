"""``scripts/bench families``: per model family and quant, the first token plain against the file
route, what the decoder evaluated after the restore, and the memory each used.

The models: the tiny random-weight ones of each architecture that scripts/tiny-models makes (dense,
sliding-window, hybrid recurrent and convolution, MoE) and SmolLM2 in every quant set-up makes.  One
onebitd per model, on the embedded default config with ``model.path`` changed, a ggml provider, the
file route forced (``route_by = "length"``).  Each pair is one fresh prompt asked both ways: plain
straight to the decoder's llama-server (``cache_prompt: false``: the whole prompt prefilled) and
through onebitd (the provider prefills, the decoder restores); the order alternates pair by pair
(ABBA), after one warm-up pair, so that the machine's drift falls on both sides alike.  Printed per
model: the load-time probe's verdict, the medians and spreads, the ratio plain / file (above 1: the
file route's first token came sooner), the decoder's prompt_n after the restore (worst of the
pairs), the memory estimate and the measured RSS of the decoder and the provider.  The ggml
provider is the decoder's own build: its handoff is exact, so no fidelity distance is printed
(``bench providers`` measures OpenVINO's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_plot  # noqa: E402
from bench_handoff import Rig, first_byte_ms, open_rig, prompt_of  # noqa: E402

from supervisor import config as configuration  # noqa: E402
from supervisor.config import Config, locate  # noqa: E402
from supervisor.errors import ConfigError  # noqa: E402
from supervisor.models.memory import rss_mib  # noqa: E402

FAMILIES = (
    "llama-dense",
    "llama-moe",
    "qwen3moe-moe",
    "gemma3-dense",
    "gpt-oss-moe",
    "qwen35-dense",
    "qwen35moe-moe",
    "granitehybrid-dense",
    "lfm2-dense",
    "lfm2-noswa-dense",
)
QUANTS = tuple(f"SmolLM2-135M-Instruct.{q}" for q in ("Q4_0", "Q4_1", "Q4_K_M", "Q6_K", "Q8_0", "F16"))


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", type=int, default=5, help="measured pairs per model, after one warm-up (5)")
    parser.add_argument("--tokens", type=int, default=600, help="prompt tokens (600)")
    parser.add_argument("--models", nargs="*", help="model names (default: every family and quant)")
    parser.add_argument("--quick", action="store_true", help="two models, one pair, a 200-token prompt: it runs")


def model_path(name: str, tiny: Path) -> Path:
    embedded = locate.embedded_model()
    if embedded is not None and embedded.stem == name:
        return embedded
    path = tiny / f"{name}.gguf"
    if not path.is_file():
        raise ConfigError([f"bench families: no {path} (run scripts/setup: it makes the test models)"])
    return path


def family_config(runtime_dir: Path, model: Path) -> Config:
    data = configuration.unstructure(Config())
    data["server"].update(port=0, runtime_dir=str(runtime_dir), shutdown_grace_s=10.0)
    data["cache"].update(dir=str(runtime_dir / "prefix"), ram_mib=0)
    data["model"].update(path=str(model), parallel=2, ctx_size=4096)
    data["decoder"]["threads"] = 1
    data["hybrid"].update(enabled=True, min_prompt_tokens=64, route_by="length")
    data["provider"] = [{"kind": "llama-server", "name": "ggml", "threads": 1}]
    config = configuration.structure(data, "bench")
    configuration.check(config, "bench")
    return config


async def pairs(rig: Rig, n: int, tokens: int) -> dict[str, Any]:
    """One warm-up pair, then ``n``, the sides alternating who goes first."""
    plain: list[float] = []
    file: list[float] = []
    decoder_n: list[int] = []
    count = 0
    for i in range(n + 1):
        prompt, count = await prompt_of(rig.decoder, tokens, salt=7000 + i)
        body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "stream": True}
        order = ("plain", "file") if i % 2 == 0 else ("file", "plain")
        measured: dict[str, float] = {}
        for side in order:
            if side == "plain":
                ms, _ = await first_byte_ms(rig.decoder, "/completion", {**body, "cache_prompt": False, "id_slot": 1})
            else:
                ms, timings = await first_byte_ms(rig.front, "/completion", body)
                if i:
                    decoder_n.append(int(timings.get("prompt_n", -1)))
            measured[side] = ms
        if i:  # the first pair warms both paths up
            plain.append(measured["plain"])
            file.append(measured["file"])
    return {"tokens": count, "plain": plain, "file": file, "decoder_prompt_n": max(decoder_n)}


async def measure(name: str, tiny: Path, n: int, tokens: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ob-bench-", dir="/tmp") as tmp:
        async with open_rig(family_config(Path(tmp), model_path(name, tiny)), check_fidelity=False) as rig:
            model = rig.daemon.models.default
            row = await pairs(rig, n, tokens)
            (provider,) = model.parts.llama_providers()
            row.update(
                restores=model.parts.capability.restores.value,
                estimate_mib=model.estimate_mib,
                decoder_mib=rss_mib(model.decoder.pid) or 0.0,
                provider_mib=rss_mib(provider.child.pid) or 0.0,
                swa_full=model.swa_full,
            )
    return row


def spread(values: list[float]) -> str:
    return f"{min(values):.0f}-{max(values):.0f}" if len(values) > 1 else "-"


async def run(args: argparse.Namespace) -> int:
    found = await trio.run_process(
        [str(ROOT / "scripts" / "tiny-models"), "--print-path", sys.executable], capture_stdout=True
    )
    tiny = Path(found.stdout.decode().strip())
    import bench  # the machine line, measured the same way for every subcommand

    print(f"machine: {bench.machine()}")
    ticks, began = bench.busy_ticks(), time.monotonic()
    names = args.models or (["llama-dense", "qwen35-dense"] if args.quick else [*FAMILIES, *QUANTS])
    n = 1 if args.quick else args.pairs
    tokens = 200 if args.quick else args.tokens
    print(f"first streamed token, ms: {n} pair(s) per model after 1 warm-up, the order alternating (ABBA)")
    print("plain: llama-server direct, cache_prompt false; file: through onebitd, a ggml provider prefilling")
    header = (
        f"{'model':<32} {'restores':<8} {'tokens':>6} {'plain':>7} {'spread':>11} {'file':>7} {'spread':>11}"
        f" {'plain/file':>10} {'prompt_n':>8} {'est MiB':>8} {'decoder':>8} {'provider':>8}"
    )
    print(header)
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        row = rows[name] = await measure(name, tiny, n, tokens)
        plain, file = statistics.median(row["plain"]), statistics.median(row["file"])
        label = name + (" (swa-full)" if row["swa_full"] else "")
        print(
            f"{label:<32} {row['restores']:<8} {row['tokens']:>6} {plain:>7.0f} {spread(row['plain']):>11}"
            f" {file:>7.0f} {spread(row['file']):>11} {plain / file:>9.2f}x {row['decoder_prompt_n']:>8}"
            f" {row['estimate_mib']:>8.0f} {row['decoder_mib']:>8.0f} {row['provider_mib']:>8.0f}",
            flush=True,
        )
    print("prompt_n: the decoder's prompt tokens after the restore (worst pair); memory: RSS after the run, MiB")
    cpus = (bench.busy_ticks() - ticks) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - began)
    print(f"CPU busy during the run: {cpus:.2f} of {os.cpu_count()} CPUs, this benchmark's own processes included")
    if args.plot:
        bench_plot.write(args.plot, "scripts/bench families", family_figures(rows), quick=args.quick)
    return 0


def family_figures(rows: dict[str, dict[str, Any]]) -> list[bench_plot.Panel]:
    """One prompt length for every model: no axis to put it on, so the table as bars, the first
    token each way per model and the ratio plain / file."""
    tokens = max(row["tokens"] for row in rows.values())
    return [
        bench_plot.Bars(
            f"first streamed token, a {tokens}-token prompt",
            "ms",
            {name: {"plain": row["plain"], "file route": row["file"]} for name, row in rows.items()},
            log_y=True,
        ),
        bench_plot.Bars(
            "plain / file route (above 1: the file route's first token sooner)",
            "ratio of the medians",
            {
                name: {"plain / file": [statistics.median(row["plain"]) / statistics.median(row["file"])]}
                for name, row in rows.items()
            },
            reference=1.0,
        ),
    ]
