"""A long run, bounded: onebitd under mixed load for hours, its resources sampled (docs/reliability.md).

    scripts/soak [--duration S] [--sample-s S] [--out DIR] [--quick]    (python -m chaos.soak)

onebitd runs as a process of its own (``python -m supervisor.daemon``, the ``onebitd`` entry point,
on a config written under ``--out``), so that what is sampled is onebitd's and not this client's.
It serves two models under ``models.max_loaded = 1``: the embedded SmolLM2 ("chat", the default) and
a tiny random-weight model of scripts/tiny-models ("tiny"), with the prefix store on and bounded by
``cache.max_bytes``.  Two lanes of load keep at most two requests in flight, a pause after each (the
machine is shared: boundedness is the point, not throughput):

* agent sessions: multi-turn chats, each turn the previous ones plus a new message, so that every
  turn continues a prefix a slot or the store holds;
* mixed: one-shot chats and completions, streamed and whole; streams left after their first events
  (the client hangs up mid-way); every ``swap_s`` a request for "tiny", which unloads "chat" to
  load it (a model swap; the next "chat" request swaps back);
* every ``crash_s`` the loaded model's decoder is SIGKILLed, by the pid ``/onebit/status`` names
  (checked to be onebitd's child), and its restart awaited.

Every ``--sample-s`` one row goes to ``samples.csv``: onebitd's RSS, open fds and threads
(/proc/<pid>/status, /proc/<pid>/fd), the state directories' bytes and files (``<runtime>/**/state``),
the prefix store's bytes, and temporary files (``.tmp-*``, ``*.tmp``) in both.  At the end each series
is judged (:func:`judge`), the verdicts printed and the series drawn in ``samples.png``.  Exit status
1 when a series is unbounded, a request got a wrong answer or none, a killed decoder did not come
back, or onebitd left a process behind; 2 for a set-up problem.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import os
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import tomli_w
import trio

from supervisor.config import locate

from .traffic import CHAT, Tally, ask, body_for, judge_whole

ROOT = Path(__file__).resolve().parent.parent

TINY = "llama-dense.gguf"  # scripts/tiny-models's smallest dense model: a swap's load takes well under a second
# About 400 tokens of SmolLM2's vocabulary: above cache.min_tokens, so every agent turn's prefix is kept.
SYSTEM = "You are a careful assistant for a warehouse. " + " ".join(
    f"Shelf {i} holds {i * 7 % 13} boxes of part {i * 31 % 97}." for i in range(40)
)
QUESTIONS = ("Which shelf holds the most boxes?", "Name a part.", "Sum two shelves.", "Say the first shelf again.")
TURNS = (3, 7)  # an agent session's turns, at least and at most
PAUSE_S = 0.5  # after each request, per lane: the soak shares 2 cores with other work
REQUEST_BOUND_S = 240.0  # one request on these models never takes this long; past it, it is lost
RESTART_BOUND_S = 180.0  # a killed decoder is back (or its model unloaded by a swap) within this
READY_BOUND_S = 300.0
# Each model's store: a dozen agent prefixes of SmolLM2 (about 9 MiB each), so eviction runs all along.
STORE_MAX_MIB = 128
STOP_GRACE_S = 60.0  # onebitd's own shutdown_grace_s is 10 s; its children's stop comes on top
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_libc = ctypes.CDLL(None, use_errno=True)  # resolved here: dlopen in a forked child can deadlock


@attrs.frozen
class Pace:
    duration_s: float
    sample_s: float
    swap_s: float
    crash_s: float


QUICK = Pace(duration_s=180.0, sample_s=10.0, swap_s=30.0, crash_s=60.0)


# -- what is sampled, and the judgement ------------------------------------------------------------


@attrs.frozen
class Series:
    name: str  # the CSV column
    label: str  # the picture's axis
    floor: float  # a change this small is the measure's own resolution, never growth


SERIES = (
    Series("rss_mib", "onebitd RSS (MiB)", 4.0),
    Series("fds", "onebitd open fds", 4.0),
    Series("threads", "onebitd threads", 2.0),
    Series("state_mib", "state directories (MiB)", 1.0),
    Series("state_files", "state directories (files)", 2.0),
    Series("store_mib", "prefix store (MiB)", 1.0),
    Series("temp_files", "temporary files", 1.0),
)
# Beside the judged series: what the load did by then.
COUNTS = ("requests", "correct", "clean", "failed", "kills", "swaps")


@attrs.frozen
class Verdict:
    bounded: bool
    growth: float  # the least-squares line's rise over the judged samples
    spread: float  # the samples' range about that line (at least the series' floor)
    judged: int  # samples after the first quarter


def judge(times: Sequence[float], values: Sequence[float], floor: float) -> Verdict:
    """Bounded: after the first quarter of the run (the warm-up: pools filling, the store reaching
    its budget), the series grows by no more than its spread.  The growth is the rise of the
    least-squares line through those samples, over their time span; the spread is the range of the
    samples about that line, at least ``floor``.  A steady leak rises by more than it scatters; a
    flat series, a sawtooth under a budget and a lone spike do not."""
    if not times:
        return Verdict(True, 0.0, floor, 0)
    start = times[0] + (times[-1] - times[0]) / 4
    points = [(t, v) for t, v in zip(times, values, strict=True) if t >= start]
    if len(points) < 3:
        return Verdict(True, 0.0, floor, len(points))
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in points)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in points) / var_t if var_t else 0.0
    residuals = [v - (mean_v + slope * (t - mean_t)) for t, v in points]
    growth = slope * (points[-1][0] - points[0][0])
    spread = max(max(residuals) - min(residuals), floor)
    return Verdict(growth <= spread, growth, spread, n)


def proc_status(pid: int) -> dict[str, str]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def is_temp(path: Path) -> bool:
    return path.name.startswith(".tmp-") or path.name.endswith(".tmp")


def files_under(top: Path) -> list[tuple[Path, int]]:
    """Every regular file below ``top`` and its size (files that vanish meanwhile are skipped)."""
    found = []
    for path in top.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                found.append((path, path.stat().st_size))
        except OSError:
            continue
    return found


def sample(pid: int, runtime: Path, store: Path) -> dict[str, float]:
    status = proc_status(pid)
    state = [f for top in runtime.rglob("state") if top.is_dir() for f in files_under(top)]
    stored = files_under(store)
    return {
        "rss_mib": round(int(status["VmRSS"].split()[0]) / 1024, 2),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(status["Threads"]),
        "state_mib": round(sum(size for _, size in state) / 2**20, 3),
        "state_files": len(state),
        "store_mib": round(sum(size for _, size in stored) / 2**20, 3),
        "temp_files": sum(is_temp(path) for path, _ in state + stored),
    }


def descendants(pid: int) -> set[int]:
    """``pid``'s children and theirs (/proc/<pid>/task/<tid>/children)."""
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                children = Path(f"/proc/{parent}/task/{tid}/children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    frontier.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# -- onebitd as a process of its own -------------------------------------------------------------


def write_config(work: Path, tiny: Path, pace: Pace) -> Path:
    data = {
        "server": {"host": "127.0.0.1", "port": 0, "runtime_dir": str(work / "run"), "shutdown_grace_s": 10.0},
        "model": [
            {"name": "chat", "path": "", "ctx_size": 4096, "parallel": 2},
            {"name": "tiny", "path": str(tiny), "ctx_size": 1024, "parallel": 1},
        ],
        "models": {"default": "chat", "max_loaded": 1},
        "decoder": {
            "threads": 1,
            "health": {"interval_s": 1.0, "timeout_s": 5.0, "failures": 3},
            # A kill every crash_s: never so many in a window that the decoder is given up on.
            "restart": {"backoff_initial_s": 0.2, "backoff_max_s": 2.0, "max_failures": 20, "window_s": 60.0},
        },
        "cache": {"dir": str(work / "store"), "min_tokens": 64, "ram_mib": 0, "max_bytes": STORE_MAX_MIB * 2**20},
        "log": {"level": "info"},
    }
    path = work / "onebit.toml"
    path.write_text(tomli_w.dumps(data))
    return path


@attrs.define
class Onebitd:
    process: subprocess.Popen[bytes]
    url: str
    runtime: Path
    store: Path
    seen: set[int] = attrs.Factory(set)  # every descendant ever sampled: each must be gone at the end

    @property
    def pid(self) -> int:
        return self.process.pid


async def wait_listening(log: Path, process: subprocess.Popen[bytes]) -> str:
    while True:  # onebitd's log, another process's file: polled
        for line in (await trio.Path(log).read_text(errors="replace")).splitlines():
            if " listening on " in line:
                return line.rsplit(" listening on ", 1)[1].split(",")[0].strip()
        if process.poll() is not None:
            raise SetupError(f"onebitd exited with {process.returncode} before listening; see {log}")
        await trio.sleep(0.2)


class SetupError(Exception):
    """The soak cannot run here: the figures would mean nothing."""


@asynccontextmanager
async def open_onebitd(out: Path, pace: Pace) -> AsyncIterator[Onebitd]:
    """onebitd on a fresh runtime and store under ``out``; stopped (SIGTERM, then SIGKILL after
    STOP_GRACE_S) and reaped on the way out, and every descendant it ever had checked gone."""
    tiny = tiny_model()
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    config = write_config(work, tiny, pace)
    log = out / "onebitd.log"
    env = {k: v for k, v in os.environ.items() if k not in ("ONEBIT_CONFIG", "JOURNAL_STREAM")}
    with log.open("wb") as sink:
        # Popen, not trio's open_process: forked by the trio thread itself (PR_SET_PDEATHSIG is tied
        # to the forking thread, and trio forks on a worker thread that retires when idle).
        process = subprocess.Popen(  # noqa: ASYNC220
            [sys.executable, "-m", "supervisor.daemon", "--config", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            preexec_fn=die_with_the_soak,  # forked by the trio thread, which lives as long as the soak
        )
    od = Onebitd(process, "", work / "run", work / "store")
    try:
        with trio.fail_after(READY_BOUND_S):
            od.url = await wait_listening(log, process)
            async with httpx.AsyncClient(base_url=od.url, timeout=10) as client:
                # The decoder's start, in another process: polled.
                while (await client.get("/health")).status_code != 200:  # noqa: ASYNC110
                    await trio.sleep(0.5)
        yield od
    finally:
        with trio.CancelScope(shield=True):
            od.seen |= descendants(od.pid)
            process.send_signal(signal.SIGTERM)
            try:
                await trio.to_thread.run_sync(lambda: process.wait(STOP_GRACE_S))
            except subprocess.TimeoutExpired:
                process.kill()
                await trio.to_thread.run_sync(process.wait)
            with trio.move_on_after(10):
                while any(alive(pid) for pid in od.seen):  # noqa: ASYNC110  # other processes' exits
                    await trio.sleep(0.1)


def die_with_the_soak() -> None:
    """preexec_fn: the kernel SIGKILLs onebitd when the thread that forked it (this one) ends, the
    soak killed included; onebitd's own children die with it the same way."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def tiny_model() -> Path:
    found = subprocess.run(
        [str(ROOT / "scripts" / "tiny-models"), "--print-path", sys.executable],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    ).stdout.strip()
    path = Path(found) / TINY if found else None
    if path is None or not path.is_file():
        raise SetupError("no tiny models: run scripts/setup (it makes them)")
    return path


# -- the load ------------------------------------------------------------------------------------


@attrs.define
class Load:
    client: httpx.AsyncClient
    od: Onebitd
    pace: Pace
    rng: random.Random
    tally: Tally = attrs.Factory(Tally)
    kills: int = 0
    restart_s: list[float] = attrs.Factory(list)
    marks: list[tuple[float, str]] = attrs.Factory(list)  # (run time, what): the kills

    async def agent_lane(self, until: float) -> None:
        session = 0
        while trio.current_time() < until:
            session += 1
            messages = [{"role": "system", "content": f"Session {session}. {SYSTEM}"}]
            for turn in range(self.rng.randint(*TURNS)):
                if trio.current_time() >= until:
                    return
                messages.append({"role": "user", "content": f"{QUESTIONS[turn % len(QUESTIONS)]} ({turn})"})
                answer = await self.agent_turn(messages)
                messages.append({"role": "assistant", "content": answer})
                await trio.sleep(PAUSE_S)

    async def agent_turn(self, messages: list[dict[str, str]]) -> str:
        """One turn, retried after a clean error (a kill, a swap); the reply's text."""
        body = {"messages": messages, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        for _ in range(10):
            with trio.move_on_after(REQUEST_BOUND_S):
                try:
                    reply = await self.client.post(CHAT, json=body)
                except httpx.HTTPError as exc:
                    self.tally.add("bad", f"agent turn: {type(exc).__name__}: {exc}")
                    return "..."
                verdict, note = judge_whole(reply.status_code, reply.headers, reply.content, 16)
                self.tally.add(verdict, f"agent turn: {note}")
                if verdict == "ok":
                    return str(reply.json()["choices"][0]["message"]["content"])
                if verdict != "clean":
                    return "..."
                await trio.sleep(1.0)  # Retry-After: 1
                continue
            self.tally.add("lost", f"agent turn: no answer within {REQUEST_BOUND_S:g}s")
            return "..."
        return "..."

    async def mixed_lane(self, until: float) -> None:
        next_swap = trio.current_time() + self.pace.swap_s
        i = 0
        while trio.current_time() < until:
            i += 1
            pick = self.rng.random()
            if trio.current_time() >= next_swap:
                next_swap += self.pace.swap_s
                body = body_for(f"tiny {i}", stream=pick < 0.5, tokens=8, model="tiny")
                verdict, note, _ = await ask(self.client, body, bound=REQUEST_BOUND_S)
                self.tally.add(verdict, f"tiny: {note}")
            elif pick < 0.2:
                await self.hang_up(body_for(f"Tell a long story, number {i}.", stream=True, tokens=64, chat=True))
            else:
                chat = pick < 0.6
                body = body_for(f"Say hello, {i}.", stream=self.rng.random() < 0.5, tokens=8, chat=chat)
                verdict, note, _ = await ask(self.client, body, chat=chat, bound=REQUEST_BOUND_S)
                self.tally.add(verdict, f"mixed: {note}")
            await trio.sleep(PAUSE_S)

    async def hang_up(self, body: dict[str, Any]) -> None:
        """A stream the client leaves after its first two events (or a clean error)."""
        with trio.move_on_after(REQUEST_BOUND_S) as bound:
            try:
                async with self.client.stream("POST", CHAT, json=body) as reply:
                    if reply.status_code != 200:
                        verdict, note = judge_whole(reply.status_code, reply.headers, await reply.aread(), None)
                        self.tally.add(verdict, f"hang-up: {note}")
                        return
                    events = 0
                    async for line in reply.aiter_lines():
                        events += line.startswith("data:")
                        if events >= 2:
                            break
            except httpx.HTTPError as exc:
                self.tally.add("bad", f"hang-up: {type(exc).__name__}: {exc}")
                return
        self.tally.add("lost" if bound.cancelled_caught else "hung_up", "hang-up: no first events")

    async def crash_lane(self, until: float, started: float) -> None:
        while True:
            await trio.sleep(self.pace.crash_s)
            if trio.current_time() >= until:
                return
            await self.kill_decoder(started)

    async def kill_decoder(self, started: float) -> None:
        """SIGKILL the loaded model's decoder, then wait for a new one (or the model's unload)."""
        loaded = [m for m in await self.models() if m["state"] == "loaded" and m["pid"]]
        if not loaded:
            return  # a swap in progress: the next period kills
        name, pid = loaded[0]["name"], int(loaded[0]["pid"])
        if pid not in descendants(self.od.pid):
            self.tally.notes.append(f"failed: status names decoder pid {pid}, not onebitd's child")
            return
        os.kill(pid, signal.SIGKILL)
        self.kills += 1
        killed_at = trio.current_time()
        self.marks.append((killed_at - started, "kill"))
        with trio.move_on_after(RESTART_BOUND_S) as bound:
            while True:  # onebitd's children: another process's state, polled
                model = next(m for m in await self.models() if m["name"] == name)
                if model["state"] == "unloaded" or (model["state"] == "loaded" and model["pid"] not in (None, pid)):
                    break
                await trio.sleep(0.25)
        if bound.cancelled_caught:
            self.tally.notes.append(f"failed: {name}'s decoder not back {RESTART_BOUND_S:g}s after its kill")
        else:
            self.restart_s.append(trio.current_time() - killed_at)
            print(f"killed {name}'s decoder (pid {pid}), back after {self.restart_s[-1]:.1f} s", flush=True)

    async def models(self) -> list[dict[str, Any]]:
        reply = await self.client.get("/onebit/status")
        models: list[dict[str, Any]] = reply.json()["models"]["models"]
        return models


# -- sampling, the CSV and the picture ------------------------------------------------------------


async def sample_lane(
    load: Load, until: float, started: float, csv_path: Path, png_path: Path
) -> list[dict[str, float]]:
    rows: list[dict[str, float]] = []
    columns = ["t_s", *(s.name for s in SERIES), *COUNTS]
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        while True:
            now = trio.current_time()
            status = (await load.client.get("/onebit/status")).json()
            load.od.seen |= descendants(load.od.pid)
            row = {
                "t_s": round(now - started, 1),
                **sample(load.od.pid, load.od.runtime, load.od.store),
                "requests": load.tally.sent,
                "correct": load.tally.ok,
                "clean": load.tally.clean,
                "failed": load.tally.lost + load.tally.bad,
                "kills": load.kills,
                "swaps": status["models"]["swaps"],
            }
            rows.append(row)
            writer.writerow(row)
            handle.flush()
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            if len(rows) % 10 == 0:  # a picture of the run so far, for a look during a long one
                draw(png_path, rows, load.marks, final=False)
            if now >= until:
                return rows
            await trio.sleep_until(min(now + load.pace.sample_s, until))


def verdicts(rows: Sequence[dict[str, float]]) -> dict[str, Verdict]:
    times = [row["t_s"] for row in rows]
    return {s.name: judge(times, [row[s.name] for row in rows], s.floor) for s in SERIES}


def draw(path: Path, rows: Sequence[dict[str, float]], marks: Sequence[tuple[float, str]], *, final: bool) -> None:
    """One panel per series against the run's minutes; the first quarter (not judged) shaded, the
    kills as dotted lines, and each panel's verdict in its title."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the picture is a file
    from matplotlib.figure import Figure

    judged = verdicts(rows)
    minutes = [row["t_s"] / 60 for row in rows]
    figure = Figure(figsize=(12, 10), layout="constrained")
    figure.suptitle(f"onebitd soak, {minutes[-1]:.0f} min" + ("" if final else " (so far)"), fontsize=11)
    axes = figure.subplots(4, 2).flatten()
    for ax, series in zip(axes, SERIES, strict=False):
        verdict = judged[series.name]
        ax.plot(minutes, [row[series.name] for row in rows], "-o", markersize=2)
        ax.axvspan(minutes[0], minutes[0] + (minutes[-1] - minutes[0]) / 4, color="0.9")
        if series.name == "store_mib":
            ax.axhline(STORE_MAX_MIB, color="0.4", linestyle="--", linewidth=1, label="cache.max_bytes (per model)")
            ax.legend(fontsize=8)
        for at, _ in marks:
            ax.axvline(at / 60, color="C3", linestyle=":", linewidth=0.8)
        word = "bounded" if verdict.bounded else "UNBOUNDED"
        ax.set_title(f"{series.label}: {word} (growth {verdict.growth:.3g}, spread {verdict.spread:.3g})", fontsize=9)
        ax.set_xlabel("minutes")
        ax.grid(alpha=0.3)
    axes[-1].plot(minutes, [row["requests"] for row in rows], label="requests")
    axes[-1].set_title("load: requests sent (dotted lines: decoder kills)", fontsize=9)
    axes[-1].set_xlabel("minutes")
    figure.savefig(path, format="png", dpi=90)


# -- the command line ----------------------------------------------------------------------------


async def soak(args: argparse.Namespace) -> int:
    pace = QUICK if args.quick else Pace(args.duration, args.sample_s, args.swap_s, args.crash_s)
    out: Path = args.out
    async with (
        open_onebitd(out, pace) as od,
        httpx.AsyncClient(base_url=od.url, timeout=httpx.Timeout(REQUEST_BOUND_S, connect=10)) as client,
    ):
        print(f"onebitd pid {od.pid} at {od.url}; samples in {out / 'samples.csv'}", flush=True)
        load = Load(client, od, pace, random.Random(7))
        started = trio.current_time()
        until = started + pace.duration_s
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load.agent_lane, until)
            nursery.start_soon(load.mixed_lane, until)
            nursery.start_soon(load.crash_lane, until, started)
            rows = await sample_lane(load, until, started, out / "samples.csv", out / "samples.png")
    failed = False
    for name, verdict in verdicts(rows).items():
        failed |= not verdict.bounded
        word = "bounded" if verdict.bounded else "UNBOUNDED"
        print(
            f"{name:<12} {word:<9} growth {verdict.growth:.3g}  spread {verdict.spread:.3g}  ({verdict.judged} samples)"
        )
    draw(out / "samples.png", rows, load.marks, final=True)
    tally = load.tally
    print(
        f"requests sent {tally.sent}  correct {tally.ok}  clean error {tally.clean}  lost {tally.lost}  "
        f"bad {tally.bad}  hung up {tally.hung_up}"
    )
    restarts = ", ".join(f"{s:.1f}" for s in load.restart_s)
    print(f"decoder kills {load.kills}, back after s: {restarts or 'none'}")
    left = sorted(pid for pid in od.seen | {od.pid} if alive(pid))
    if left:
        tally.notes.append(f"failed: processes left after onebitd stopped: {left}")
    for note in tally.notes[:20]:
        print(f"    {note}")
    return 1 if failed or tally.failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=7200.0, help="seconds of load (default 2 h)")
    parser.add_argument("--sample-s", type=float, default=60.0, help="seconds between samples (default 60)")
    parser.add_argument("--swap-s", type=float, default=180.0, help="seconds between model swaps (default 180)")
    parser.add_argument("--crash-s", type=float, default=300.0, help="seconds between decoder kills (default 300)")
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK.duration_s:g} s, a sample every {QUICK.sample_s:g} s"
    )
    parser.add_argument("--out", type=Path, default=Path("soak-out"), help="the CSV, picture, log and work files")
    args = parser.parse_args()
    if locate.llama_server("") is None or locate.embedded_model() is None:
        print("scripts/soak: no llama-server or model; run scripts/setup", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        return trio.run(soak, args)
    except SetupError as exc:
        print(f"scripts/soak: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
