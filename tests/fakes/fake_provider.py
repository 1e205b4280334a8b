"""A stand-in prefill provider, for fault injection.  Standard library only.

As an ``exec`` provider (no arguments) it reads one job from stdin, writes the state file, logs on
stderr and prints its claim as the last stdout line, after a decoy progress line (so a reader that
takes any line but the last gets the wrong count).  With ``--worker`` it is a ``worker`` provider: it
talks one JSON object per line over the socket whose fd is in ``ONEBIT_PROVIDER_FD``, says
``{"ready": true, "ping": true}`` first and answers ``{"id", "n_tokens", "prefill_ms"}`` per job, and
``{"pong": n}`` to each ``{"ping": n}`` from its reading thread, even while a job runs (jobs and
cancels are done in order on the main thread).

The "state file" it writes is JSON, ``{"fake_state": true, "tokens": [...]}`` (the tokens it says it
prefilled), which the fake llama-server accepts on restore (tests/fakes/llama/slots.py).

Modes: the fields of :class:`Modes`, read from the ``provider`` section of the control file
(tests/fakes/fake_control.py; tests write it with ``Control.set(provider=Modes(...))``) for every job:

    mode        what to do with a job (default ok):
        ok        write the file with every token and claim them all
        fail      exec: exit 3 without writing; worker: answer {"id", "error"} and keep going
        crash     write the file, then SIGKILL itself
        hang      write the file, then never answer.  exec: first start a grandchild ``sleep`` in
                  its own process group and write its pid to ``grandchild.pid`` beside the control
                  file (atomically, after the state file), so a test can prove the group was killed.
                  worker: a cancel for the job removes the file, as docs/protocol.md asks
        hold      write the file, log {"event": "holding", "pid", "id"}, wait for SIGUSR1, then answer
                  as ok (a job that runs as long as the test wants)
        short     write and claim one token fewer than the job has
        negative  write every token, claim n_tokens -1
        garbage   write every token; exec: the last stdout line is not JSON (exit 0); worker: the
                  answer has no id and no claim fields (with one job in flight it is that job's)
        nofile    claim every token, write no file
      A list gives the mode of the 1st, 2nd, ... job, the last one repeating.  Jobs are counted in
      the log when there is one, across processes (successive exec runs and a restarted worker go on
      down the list), else in this process.
    prefill_ms  the claimed prefill_ms (default 7.25)
    ready_on_signal  worker: true holds the {"ready": true} line until SIGUSR1 arrives (logged as
                {"event": "waiting", "pid"} once the signal is awaited)
    ping        worker: true (the default) says "ping": true in its ready line and answers pings;
                false leaves it out and answers none (pings are logged either way)

The log, ``provider.log`` beside the control file, has one JSON line per event, appended:
{"event": "start", "pid", "worker"}, {"event": "job", "pid", "mode", "job": {...the job as received...}},
{"event": "cancel", "pid", "id"}, {"event": "ping", "pid", "n"} (a worker, for each ping it read).

Only file-route jobs (``"route": "file"``) are understood.  The tests that run this program import
``PATH`` and ``Modes`` from it.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __package__:  # imported by the tests (and so read by mypy)
    from tests.fakes import fake_control
else:  # run as a program: Python put this folder first on sys.path
    import fake_control

MODES = ("ok", "fail", "crash", "hang", "hold", "short", "negative", "garbage", "nofile")
# The grandchild only has to outlive any test that waits for it to be killed.
GRANDCHILD_S = 600


@dataclass(frozen=True)
class Modes:
    mode: str | list[str] = "ok"
    prefill_ms: float = 7.25
    ready_on_signal: bool = False
    ping: bool = True

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise ValueError(f"fake provider: unknown mode {unknown[0]!r} (one of {', '.join(MODES)})")

    @property
    def modes(self) -> list[str]:
        return [self.mode] if isinstance(self.mode, str) else list(self.mode)

    def mode_for(self, index: int) -> str:
        """The mode of the job numbered ``index`` (from 0)."""
        return self.modes[min(index, len(self.modes) - 1)]


def current() -> Modes:
    return fake_control.modes("provider", Modes)


def log_event(event: str, **fields: Any) -> None:
    fake_control.append(fake_control.log_path("provider"), {"event": event, **fields})


def jobs_logged() -> int:
    return len(fake_control.events(fake_control.log_path("provider"), "job"))


def write_state(path: str, tokens: list[int]) -> None:
    Path(path).write_text(json.dumps({"fake_state": True, "tokens": tokens}))


def write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def prefill(mode: str, job: dict[str, Any]) -> dict[str, Any] | None:
    """Do what ``mode`` says with the state file; the claim to answer, None for fail and hang."""
    tokens = list(job["tokens"])
    state_file = job["state_file"]
    if mode == "fail":
        return None
    if mode == "short":
        tokens = tokens[:-1]
    if mode != "nofile":
        write_state(state_file, tokens)
    if mode == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":
        return None
    if mode == "hold":
        # SIGUSR1 is blocked (every thread of a worker: see run_worker), so only sigwait takes it.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        log_event("holding", id=job["id"])
        signal.sigwait({signal.SIGUSR1})
    return {"n_tokens": -1 if mode == "negative" else len(tokens), "prefill_ms": current().prefill_ms}


def run_exec() -> int:
    log_event("start", worker=False)
    mode = current().mode_for(jobs_logged())
    job = json.loads(sys.stdin.readline())
    log_event("job", mode=mode, job=job)
    print(f"fake provider: job {job['id']}: {len(job['tokens'])} tokens, mode {mode}", file=sys.stderr)
    claim = prefill(mode, job)
    if mode == "fail":
        print("fake provider: told to fail", file=sys.stderr)
        return 3
    if mode == "hang":
        # Same process group (we lead it); stdio inherited, like a helper a real provider might start.
        sleeper = subprocess.Popen(["sleep", str(GRANDCHILD_S)])
        pidfile = fake_control.beside(fake_control.PIDFILE)
        if pidfile is not None:
            write_atomically(pidfile, str(sleeper.pid))
        while True:
            signal.pause()
    print(json.dumps({"n_tokens": 0, "progress": "starting"}), flush=True)
    if mode == "garbage":
        print("fake provider: done, and no claim today", flush=True)
    else:
        print(json.dumps(claim), flush=True)
    # After the claim: a reader that mixed stderr into stdout would take this for the last line.
    print("fake provider: done", file=sys.stderr, flush=True)
    return 0


def read(
    sock: socket.socket, pongs: bool, send: Callable[[dict[str, Any]], None], out: queue.SimpleQueue[bytes | None]
) -> None:
    """The reading side: a ping is answered here at once, even while the main thread runs a job;
    every other line goes to ``out`` in order, then None at EOF."""
    try:
        with sock.makefile("rb") as lines:
            for raw in lines:
                try:
                    message = json.loads(raw)
                except ValueError:
                    message = None  # the main thread's json.loads fails on it, as it should
                if isinstance(message, dict) and "ping" in message:
                    log_event("ping", n=message["ping"])
                    if pongs:
                        send({"pong": message["ping"]})
                    continue
                out.put(raw)
    finally:
        out.put(None)


def run_worker() -> int:
    log_event("start", worker=True)
    sock = socket.socket(fileno=int(os.environ["ONEBIT_PROVIDER_FD"]))
    sending = threading.Lock()

    def send(data: dict[str, Any]) -> None:
        with sending:  # a pong and a job's answer, each one whole line
            sock.sendall(json.dumps(data).encode() + b"\n")

    # Blocked before the reader starts, so in every thread: only a sigwait takes SIGUSR1.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    modes = current()
    if modes.ready_on_signal:
        log_event("waiting")
        signal.sigwait({signal.SIGUSR1})
    send({"ready": True, "ping": True} if modes.ping else {"ready": True})
    received: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    threading.Thread(target=read, args=(sock, modes.ping, send, received), daemon=True).start()
    hung: dict[str, str] = {}  # job id -> its state file
    seen = 0
    while (raw := received.get()) is not None:
        message = json.loads(raw)
        if "cancel" in message:
            log_event("cancel", id=message["cancel"])
            Path(hung.pop(message["cancel"], "/nonexistent")).unlink(missing_ok=True)
            continue
        mode = current().mode_for(jobs_logged() if fake_control.log_path("provider") else seen)
        seen += 1
        log_event("job", mode=mode, job=message)
        print(f"fake worker: job {message['id']}: mode {mode}", file=sys.stderr, flush=True)
        claim = prefill(mode, message)
        if mode == "hang":
            hung[message["id"]] = message["state_file"]
        elif mode == "fail":
            send({"id": message["id"], "error": "fake provider: told to fail"})
        elif mode == "garbage":
            send({"note": "no claim here"})
        else:
            assert claim is not None
            send({"id": message["id"], **claim})
    return 0


PATH = Path(__file__)  # for the tests that run this program

if __name__ == "__main__":
    sys.exit(fake_control.provider_main(run_exec, run_worker))
