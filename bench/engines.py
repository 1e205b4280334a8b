"""The ggml and OpenVINO engines of the one llama-server build side by side, with the product's [model]
flags and ``-t``: prefill tokens per second (and per CPU-second) at a few prompt sizes, one server at a
time; the per-layer K/V error of each OpenVINO slot file against the ggml server's own for the same
prompt; and whether the OpenVINO files restore into the ggml server (``prompt_n`` 1 after the restore).

    .venv/bin/python -m bench.engines [--ggml BIN] [--openvino BIN ...] [--sizes 200,700,1500]
                                              [--plot FILE.svg]

``--openvino`` may be given several times (say, before and after a patch); each may carry
``NAME=`` in front (``--openvino old=/path/llama-server``).  ``--static`` adds each OpenVINO binary's
static (NPU) path forced on the CPU (``-np 1``; its files restore into a ``--kv-unified`` ggml
server).  docs/benchmarks.md has the figures of one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench import plot
from supervisor.config import ModelConfig, locate
from supervisor.llama import openvino, statediff, statefile
from supervisor.llama.llama_server import model_args

TEXT = (
    "The history of the city begins with a small fishing village on the river delta. Over the centuries "
    "merchants arrived from the north and the south, bringing spices, cloth, and new ideas about law, "
    "music and building. The old quarter still keeps its narrow lanes, and every spring the festival of "
    "lanterns fills the harbour with light. Scholars argue about the origin of the name; some say it "
    "comes from a word for salt, others from the name of a forgotten queen. "
)
# The product's [model] flags but ctx_size: 4096 over 4 slots is 1024 tokens a slot, and 1500 must fit.
CTX_SIZE = 8192
PROMPTS = {
    "p1": "Summarise this passage in three sentences.\n\n" + TEXT * 6,
    "p2": "You keep a list of words for the user. The list: " + ", ".join(f"word{i}" for i in range(120)) + ".",
}


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], client: httpx.Client, state_dir: Path, started_s: float) -> None:
        self.proc, self.client, self.state_dir, self.started_s = proc, client, state_dir, started_s

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = self.client.post(path, json=body)
        if reply.status_code != 200:
            raise SystemExit(f"{path}: {reply.status_code} {reply.text[:300]}")
        data: dict[str, Any] = reply.json()
        return data

    def prefill(self, prompt: object, slot: int = 0) -> dict[str, Any]:
        self.post(f"/slots/{slot}?action=erase", {})
        before = self.cpu_s()
        timings: dict[str, Any] = self.post(
            "/completion", {"prompt": prompt, "n_predict": 0, "id_slot": slot, "cache_prompt": True}
        )["timings"]
        timings["cpu_s"] = self.cpu_s() - before
        return timings


@contextmanager
def server(binary: Path, threads: int, env: dict[str, str], extra: list[str], log: Path) -> Iterator[Server]:
    work = Path(tempfile.mkdtemp(prefix="ob-eng-", dir="/tmp"))
    socket, state_dir = work / "s.sock", work / "state"
    state_dir.mkdir()
    model = locate.embedded_model()
    assert model is not None, "no embedded model: run scripts/setup"
    argv = [
        str(binary),
        *model_args(ModelConfig(ctx_size=CTX_SIZE), model),
        "--host",
        str(socket),
        "--slot-save-path",
        str(state_dir),
    ]
    argv += ["--no-webui", "--cache-ram", "0", "-t", str(threads), *extra]
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), base_url="http://llama", timeout=900)
    try:
        while True:  # a benchmark, not a test: poll the health endpoint until it answers
            if proc.poll() is not None:
                raise SystemExit(f"{binary} exited with {proc.returncode}; see {log}")
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        yield Server(proc, client, state_dir, time.monotonic() - t0)
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def prompt_tokens(s: Server, n: int) -> list[int]:
    tokens: list[int] = s.post("/tokenize", {"content": TEXT * 60})["tokens"]
    return tokens[:n]


def run_one(s: Server, label: str, sizes: list[int], reps: int, out: Path) -> dict[str, Any]:
    s.prefill("Hello there, a warm-up.")
    speeds: dict[int, tuple[float, float, float]] = {}
    runs: dict[int, list[float]] = {}  # every run's tokens/s, for the picture
    for n in sizes:
        tokens = prompt_tokens(s, n)
        s.prefill(tokens)  # the first prompt of a size: OpenVINO compiles a shape
        per_s, per_cpu_s = [], []
        for _ in range(reps):
            t = s.prefill(tokens)
            assert t["prompt_n"] == n, t
            per_s.append(float(t["prompt_per_second"]))
            per_cpu_s.append(n / t["cpu_s"] if t["cpu_s"] > 0 else 0.0)
        # On a shared machine the best of the runs is the least disturbed one: report it and the median.
        speeds[n] = (max(per_s), statistics.median(per_s), max(per_cpu_s))
        runs[n] = per_s
        print(
            f"  {label}: {n} tokens: best {speeds[n][0]:.0f} tok/s, median {speeds[n][1]:.0f}, "
            f"best {speeds[n][2]:.0f} per CPU-second (runs {[round(x) for x in per_s]})",
            flush=True,
        )
    files = {}
    for name, text in PROMPTS.items():
        s.prefill(text)
        s.post("/slots/0?action=save", {"filename": f"{name}.state"})
        files[name] = Path(shutil.copy(s.state_dir / f"{name}.state", out / f"{label}-{name}.state"))
    return {"speeds": speeds, "runs": runs, "files": files, "start_s": s.started_s, "rss_mib": s.rss_mib()}


def restores(s: Server, files: dict[str, Path]) -> dict[str, Any]:
    result = {}
    for name, path in files.items():
        shutil.copy(path, s.state_dir / path.name)
        s.post("/slots/1?action=erase", {})
        restored = s.post("/slots/1?action=restore", {"filename": path.name})
        reply = s.post("/completion", {"prompt": PROMPTS[name], "n_predict": 1, "id_slot": 1, "cache_prompt": True})
        result[name] = (reply["timings"]["prompt_n"], restored.get("timings", {}).get("restore_ms"))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engines", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ggml", type=Path, default=None, help="default: the ggml build scripts/setup made")
    parser.add_argument("--openvino", action="append", default=[], help="[NAME=]BINARY; default: setup's build")
    parser.add_argument("--sizes", default="200,700,1500")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="CPU", help="GGML_OPENVINO_DEVICE")
    parser.add_argument("--static", action="store_true", help="also the static (NPU) path forced on the CPU")
    parser.add_argument("--out", type=Path, default=None, help="where to keep the slot files and logs")
    plot.add_argument(parser)
    args = parser.parse_args()
    if args.plot:
        plot.check()  # now, not after the runs
    ggml = args.ggml or locate.llama_server("", "ggml")
    if ggml is None:
        raise SystemExit("no ggml llama-server: run scripts/setup, or give --ggml")
    openvinos = []
    for spec in args.openvino or [str(locate.llama_server("", "openvino"))]:
        name, _, path = spec.rpartition("=")
        openvinos.append((name or "openvino", Path(path)))
    out = args.out or Path(tempfile.mkdtemp(prefix="ob-engines-"))
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(n) for n in args.sizes.split(",") if n]
    runs: dict[str, dict[str, Any]] = {}

    print(f"ggml: {ggml}", flush=True)
    with server(ggml, args.threads, {}, [], out / "ggml.log") as s:
        runs["ggml"] = run_one(s, "ggml", sizes, args.reps, out)
    # llama-server logs "load_backend: loaded CPU backend from .../libggml-cpu-<variant>.so" only with -v.
    for name, path in openvinos:
        print(f"{name}: {path}", flush=True)
        cpu = {**openvino.backend_env(path), "GGML_OPENVINO_DEVICE": args.device}  # set-up's: its backend beside it
        with server(path, args.threads, cpu, [], out / f"{name}.log") as s:
            runs[name] = run_one(s, name, sizes, args.reps, out)
        if args.static:
            static = f"{name}-static"
            with server(
                path, args.threads, {**cpu, "GGML_OPENVINO_FORCE_STATIC": "1"}, ["-np", "1"], out / f"{static}.log"
            ) as s:
                runs[static] = run_one(s, static, [], args.reps, out)
    with server(ggml, args.threads, {}, [], out / "ggml-restore.log") as s:
        for name, _ in openvinos:
            runs[name]["restores"] = restores(s, runs[name]["files"])
    if args.static:
        with server(ggml, args.threads, {}, ["--kv-unified"], out / "ggml-unified-restore.log") as s:
            for name, _ in openvinos:
                runs[f"{name}-static"]["restores"] = restores(s, runs[f"{name}-static"]["files"])

    print("\ntokens/s: best / median of the runs (best per CPU-second of the server)")
    print("| build | start | peak RSS | " + " | ".join(f"{n} tokens" for n in sizes) + " |")
    print("|---|---|---|" + "---|" * len(sizes))
    for name, run in runs.items():
        cells = [
            f"{run['speeds'][n][0]:.0f} / {run['speeds'][n][1]:.0f} ({run['speeds'][n][2]:.0f})"
            for n in sizes
            if n in run["speeds"]
        ]
        if cells:
            print(f"| {name} | {run['start_s']:.1f} s | {run['rss_mib']:.0f} MiB | " + " | ".join(cells) + " |")
    print("\nper-layer error against ggml's own file (K max / V max / K last / V last); restore into ggml")
    for name, run in runs.items():
        if name == "ggml":
            continue
        for prompt, path in run["files"].items():
            errors = statediff.layer_errors(statefile.read(path), statefile.read(runs["ggml"]["files"][prompt]))
            prompt_n, restore_ms = run.get("restores", {}).get(prompt, (None, None))
            print(
                f"| {name} | {prompt} | {max(e.k for e in errors):.4f} | {max(e.v for e in errors):.4f} | "
                f"{errors[-1].k:.4f} | {errors[-1].v:.4f} | prompt_n {prompt_n} after a {restore_ms} ms restore |"
            )
    print(f"\nslot files and logs: {out}")
    if args.plot:
        plot.write(args.plot, "bench/engines.py", engine_figures(runs), quick=False)
    return 0


def engine_figures(runs: dict[str, dict[str, Any]]) -> list[plot.Panel]:
    """Prefill rate against prompt length, per build: every run's, and the best per CPU-second."""
    measured = {name: run for name, run in runs.items() if run["runs"]}
    return [
        plot.XY(
            "prefill rate against prompt length, every run",
            "prompt tokens",
            "tokens/s",
            {name: [(n, rate) for n, rates in run["runs"].items() for rate in rates] for name, run in measured.items()},
        ),
        plot.XY(
            "prefill per CPU-second of the server, the best run",
            "prompt tokens",
            "tokens per CPU-second",
            {name: [(n, speed[2]) for n, speed in run["speeds"].items()] for name, run in measured.items()},
        ),
    ]


if __name__ == "__main__":
    raise SystemExit(main())
