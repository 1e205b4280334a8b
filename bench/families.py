"""``scripts/bench families``: per model family and quant, the first token plain against the file
route on a ggml and an OpenVINO provider, what the decoder evaluated after the restore, each
engine's fidelity distances and the memory each used.

The models: the tiny random-weight ones of each architecture that scripts/tiny-models makes (dense,
sliding-window, hybrid recurrent and convolution, MoE) and SmolLM2 in every quant set-up makes
(re-quantized from its shipped Q4_1: a real model's timings per tensor type, not a quant's quality;
the tiny dense model's quants, each quantized once from its F32, are named ``llama-dense.<TYPE>``
for ``--models``, and tests/real/test_real_state_fidelity.py proves each by its state).  Per
model two onebitd side by side, each on the embedded default config with ``model.path`` changed and
the file route forced (``route_by = "length"``), the decoder on one core and its one provider on the
other: one with a ggml provider, one with an OpenVINO provider on its CPU device (which runs its
start-time check, as onebitd does: a model the backend cannot take is refused there, and its column
says so).  Each sample is one fresh prompt asked on every side: plain straight to the ggml daemon's
llama-server (``cache_prompt: false``: the whole prompt prefilled) and through each onebitd (the
provider prefills, the decoder restores); the sides' order rotates sample by sample
(bench/workloads.py's first_tokens), after one warm-up sample, so that the machine's drift falls on every
side alike.  Printed per model: the load-time probe's verdict, the medians and spreads, the ratios
plain / file (above 1: the file route's first token came sooner), the decoder's prompt_n after the
restore (worst sample), each engine's next-token distance (mean and worst, over the gate's prompts
and more, those that fit a slot), the memory estimate and the measured RSS of the decoder and each
provider.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

from bench import plot
from bench.rig import Noise, Rig, machine, open_rig, provider_of
from bench.workloads import fidelity_of, first_tokens
from supervisor import config as configuration
from supervisor.config import Config, locate
from supervisor.errors import ConfigError, ProviderError
from supervisor.llama import openvino
from supervisor.models.memory import rss_mib
from supervisor.routes import fidelity

ROOT = Path(__file__).resolve().parent.parent

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
    parser.add_argument("--pairs", type=int, default=6, help="measured samples per model and side, after a warm-up (6)")
    parser.add_argument("--tokens", type=int, default=600, help="prompt tokens (600)")
    parser.add_argument("--models", nargs="*", help="model names (default: every family and quant)")
    parser.add_argument("--fidelity", type=int, default=12, help="prompts of each engine's fidelity distances (12)")
    parser.add_argument("--no-openvino", action="store_true", help="the ggml provider only")
    parser.add_argument("--quick", action="store_true", help="two models, one pair, a 200-token prompt: it runs")


def model_path(name: str, tiny: Path) -> Path:
    embedded = locate.embedded_model()
    if embedded is not None and embedded.stem == name:
        return embedded
    path = tiny / f"{name}.gguf"
    if not path.is_file():
        raise ConfigError([f"bench families: no {path} (run scripts/setup: it makes the test models)"])
    return path


def family_config(runtime_dir: Path, model: Path, engine: str = "ggml") -> Config:
    cpus = sorted(os.sched_getaffinity(0))
    decoder_cpus, provider_cpus = ([cpus[0]], [cpus[1]]) if len(cpus) >= 2 else (cpus, cpus)
    data = configuration.unstructure(Config())
    data["server"].update(port=0, runtime_dir=str(runtime_dir), shutdown_grace_s=10.0)
    data["cache"].update(dir=str(runtime_dir / "prefix"), ram_mib=0, compile_dir=str(runtime_dir / "compiled"))
    data["model"].update(path=str(model), parallel=2, ctx_size=4096)
    data["decoder"].update(threads=1, cpu_affinity=decoder_cpus)
    data["hybrid"].update(enabled=True, min_prompt_tokens=64, route_by="length")
    provider: dict[str, Any] = {"kind": "llama-server", "name": engine, "threads": 1, "cpu_affinity": provider_cpus}
    if engine == "openvino":
        provider.update(engine="openvino", device="CPU")
    data["provider"] = [provider]
    config = configuration.structure(data, "bench")
    configuration.check(config, "bench")
    return config


@contextlib.asynccontextmanager
async def rigs_for(model: Path, with_openvino: bool) -> AsyncIterator[dict[str, Rig]]:
    """The ggml daemon, and the OpenVINO one beside it where asked, both up at once.  The OpenVINO
    daemon runs its start-time check, as onebitd does: a backend that cannot take the model is
    refused there, with its reason."""
    with tempfile.TemporaryDirectory(prefix="ob-bench-", dir="/tmp") as tmp:
        async with contextlib.AsyncExitStack() as stack:
            rigs = {
                "ggml": await stack.enter_async_context(
                    open_rig(family_config(Path(tmp) / "g", model), check_fidelity=False)
                )
            }
            if with_openvino:
                config = family_config(Path(tmp) / "o", model, "openvino")
                rigs["openvino"] = await stack.enter_async_context(open_rig(config))
            yield rigs


async def measure(name: str, tiny: Path, args: argparse.Namespace) -> dict[str, Any]:
    async with rigs_for(model_path(name, tiny), args.openvino) as rigs:
        model = rigs["ggml"].daemon.models.default
        refused = {}
        for engine, rig in rigs.items():
            stats = provider_of(rig).statistics()
            if stats.refused is not None:
                refused[engine] = stats.refused
            elif not stats.ready:  # its server never came up: the restart policy gave up on it
                refused[engine] = f"it did not start ({stats.child.last_exit if stats.child else '?'})"
        measured = {engine: rig for engine, rig in rigs.items() if engine not in refused}
        (row,) = (await first_tokens(measured, args.pairs, (args.tokens,), aa=False)).values()
        texts = [*fidelity.GATE_PROMPTS, *fidelity.prompt_set(max(0, args.fidelity - len(fidelity.GATE_PROMPTS)))]
        verdicts: dict[str, fidelity.Verdict] = {}
        failed: dict[str, str] = {}
        for engine, rig in measured.items():
            if args.fidelity and model.parts.capability.handoff:
                slot_context = rig.daemon.models.default.parts.completions.slot_context()
                try:
                    verdicts[engine] = await fidelity_of(rig, provider_of(rig), texts[: args.fidelity], slot_context)
                except ProviderError as error:  # a handoff that failed: the table says so, the run goes on
                    failed[engine] = str(error)
        row.update(
            restores=model.parts.capability.restores.value,
            estimate_mib=model.estimate_mib,
            decoder_mib=rss_mib(model.decoder.pid) or 0.0,
            provider_mib={engine: rss_mib(provider_of(rig).child.pid) or 0.0 for engine, rig in rigs.items()},
            swa_full=model.swa_full,
            refused=refused,
            verdicts=verdicts,
            failed=failed,
        )
    return row


def spread(values: list[float]) -> str:
    return f"{min(values):.0f}-{max(values):.0f}" if values else "-"


def cell(row: dict[str, Any], side: str) -> str:
    values = row.get(side, [])
    if not values:
        return f"{'refused' if side in row['refused'] else '-':>7} {'':>11}"
    return f"{statistics.median(values):>7.0f} {spread(values):>11}"


def ratio(row: dict[str, Any], side: str) -> str:
    if not row.get(side):
        return f"{'-':>7}"
    return f"{statistics.median(row['plain']) / statistics.median(row[side]):>6.2f}x"


def distances(row: dict[str, Any], engine: str) -> str:
    verdict = row["verdicts"].get(engine)
    if verdict is None:
        return f"{'failed' if engine in row['failed'] else '-':>15}"
    return f"{verdict.mean_handoff:>7.4f} {verdict.max_handoff:>7.4f}" + ("" if verdict.ok else "!")


async def run(args: argparse.Namespace) -> int:
    found = await trio.run_process(
        [str(ROOT / "scripts" / "tiny-models"), "--print-path", sys.executable], capture_stdout=True
    )
    tiny = Path(found.stdout.decode().strip())

    args.openvino = not args.no_openvino and openvino.llama_server("") is not None
    if args.quick:
        args.pairs, args.tokens, args.fidelity = 1, 200, 0
    print(f"machine: {machine()}")
    noise = Noise.start([])
    names = args.models or (["llama-dense", "qwen35-dense"] if args.quick else [*FAMILIES, *QUANTS])
    engines = ("ggml", "openvino") if args.openvino else ("ggml",)
    print(
        f"first streamed token, ms: {args.pairs} sample(s) per cell after 1 warm-up, the same fresh prompt on every"
        " side, the sides in rotating order"
    )
    print(
        "plain: llama-server direct, cache_prompt false; ggml, openvino: the file route through an onebitd with that"
        " provider (decoder and provider on a core each)"
    )
    print(
        f"{'model':<32} {'restores':<8} {'tokens':>6} {'plain':>7} {'spread':>11}"
        + "".join(f" {engine:>7} {'spread':>11}" for engine in engines)
        + "".join(f" {'/' + engine:>7}" for engine in engines)
        + f" {'prompt_n':>8}"
        + "".join(f" {'TV ' + engine + ' mean worst':>15}" for engine in engines)
        + f" {'est MiB':>8} {'decoder':>8}"
        + "".join(f" {engine:>8}" for engine in engines)
    )
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        row = rows[name] = await measure(name, tiny, args)
        label = name + (" (swa-full)" if row["swa_full"] else "")
        prompt_n = max(row["decoder_prompt_n"].values())
        print(
            f"{label:<32} {row['restores']:<8} {row['tokens']:>6} {cell(row, 'plain')}"
            + "".join(f" {cell(row, engine)}" for engine in engines)
            + "".join(f" {ratio(row, engine)}" for engine in engines)
            + f" {prompt_n:>8}"
            + "".join(f" {distances(row, engine)}" for engine in engines)
            + f" {row['estimate_mib']:>8.0f} {row['decoder_mib']:>8.0f}"
            + "".join(f" {row['provider_mib'].get(engine, 0):>8.0f}" for engine in engines),
            flush=True,
        )
    print("/engine: plain / the file route on it (above 1: sooner); prompt_n: the decoder's prompt tokens after")
    print("a restore (the worst sample of either engine); TV: next-token total-variation distance, handoff against")
    print(f"the decoder's cached path, over up to {args.fidelity} prompts that fit a slot ('!': over the bound);")
    print("memory: RSS after the run, MiB (decoder, then each provider)")
    for name, row in rows.items():
        for engine, why in row["refused"].items():
            print(f"refused: {name} on {engine}: {why}")
        for engine, why in row["failed"].items():
            print(f"fidelity not measured: {name} on {engine}: {why}")
    print(noise.report([]))
    if args.plot:
        plot.write(args.plot, "scripts/bench families", family_figures(rows), quick=args.quick)
    return 0


def family_figures(rows: dict[str, dict[str, Any]]) -> list[plot.Panel]:
    """One prompt length for every model: no axis to put it on, so the table as bars, the first
    token each way per model and the ratio plain / file."""
    tokens = max(row["tokens"] for row in rows.values())
    names = {"plain": "plain", "ggml": "file route", "openvino": "file route, openvino"}
    return [
        plot.Bars(
            f"first streamed token, a {tokens}-token prompt",
            "ms",
            {name: {names[side]: row[side] for side in names if row.get(side)} for name, row in rows.items()},
            log_y=True,
        ),
        plot.Bars(
            "plain / file route (above 1: the file route's first token sooner)",
            "ratio of the medians",
            {
                name: {
                    f"plain / {names[side]}": [statistics.median(row["plain"]) / statistics.median(row[side])]
                    for side in ("ggml", "openvino")
                    if row.get(side)
                }
                for name, row in rows.items()
            },
            reference=1.0,
        ),
    ]
