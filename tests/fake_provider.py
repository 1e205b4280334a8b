"""A stand-in prefill provider, for fault injection.  Standard library only.

As an ``exec`` provider (no arguments) it reads one job from stdin, writes the state file, logs on
stderr and prints its claim as the last stdout line, after a decoy progress line (so a reader that
takes any line but the last gets the wrong count).  With ``--worker`` it is a ``worker`` provider: it
talks one JSON object per line over the socket whose fd is in ``ONEBIT_PROVIDER_FD``, says
``{"ready": true}`` first and answers ``{"id", "n_tokens", "prefill_ms"}`` per job.

The "state file" it writes is JSON, ``{"fake_state": true, "tokens": [...]}`` (the tokens it says it
prefilled), which tests/fake_decoder.py accepts on restore.

Environment:

    FAKE_PROVIDER_MODE       what to do with a job (default ok):
        ok        write the file with every token and claim them all
        fail      exec: exit 3 without writing; worker: answer {"id", "error"} and keep going
        crash     write the file, then SIGKILL itself
        hang      write the file, then never answer.  exec: first start a grandchild ``sleep`` in
                  its own process group and write its pid to FAKE_PROVIDER_PIDFILE (atomically,
                  after the state file), so a test can prove the group was killed.  worker: a
                  cancel for the job removes the file, as docs/protocol.md asks
        short     write and claim one token fewer than the job has
        negative  write every token, claim n_tokens -1
        garbage   write every token; exec: the last stdout line is not JSON (exit 0); worker: the
                  answer has no id and no claim fields (with one job in flight it is that job's)
        nofile    claim every token, write no file
      A comma-separated list gives the mode of the 1st, 2nd, ... job, the last one repeating.  Jobs
      are counted in FAKE_PROVIDER_LOG when it is set, across processes (successive exec runs and a
      restarted worker go on down the list), else in this process.
    FAKE_PROVIDER_LOG        a file: one JSON line per event, appended:
                             {"event": "start", "pid", "worker"}, {"event": "job", "pid", "mode",
                             "job": {...the job as received...}}, {"event": "cancel", "pid", "id"}
    FAKE_PROVIDER_PIDFILE    hang, exec: where the grandchild's pid goes
    FAKE_PROVIDER_PREFILL_MS the claimed prefill_ms (default 7.25)
    FAKE_PROVIDER_READY      worker: ``signal`` holds the {"ready": true} line until SIGUSR1 arrives
                             (logged as {"event": "waiting", "pid"} once the signal is awaited)

Only file-route jobs (``"route": "file"``) are understood.  The tests that run this program import
``PATH``, ``events``, ``reaped`` and ``gone`` from it (the program itself needs none of them).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

MODES = ("ok", "fail", "crash", "hang", "short", "negative", "garbage", "nofile")
# The grandchild only has to outlive any test that waits for it to be killed.
GRANDCHILD_S = 600


def log_event(event: str, **fields: Any) -> None:
    path = os.environ.get("FAKE_PROVIDER_LOG")
    if not path:
        return
    line = json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n"
    # One write on an O_APPEND descriptor: lines from several processes never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def jobs_logged() -> int:
    path = os.environ.get("FAKE_PROVIDER_LOG")
    if not path or not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as f:
        return sum(1 for raw in f if json.loads(raw).get("event") == "job")


def mode_for(index: int) -> str:
    modes = [m.strip() for m in os.environ.get("FAKE_PROVIDER_MODE", "ok").split(",")]
    mode = modes[min(index, len(modes) - 1)] or "ok"
    if mode not in MODES:
        sys.exit(f"fake provider: unknown FAKE_PROVIDER_MODE {mode!r} (one of {', '.join(MODES)})")
    return mode


def prefill_ms() -> float:
    return float(os.environ.get("FAKE_PROVIDER_PREFILL_MS", "7.25"))


def write_state(path: str, tokens: list[int]) -> None:
    Path(path).write_text(json.dumps({"fake_state": True, "tokens": tokens}))


def write_atomically(path: str, text: str) -> None:
    temporary = f"{path}.tmp"
    Path(temporary).write_text(text)
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
    return {"n_tokens": -1 if mode == "negative" else len(tokens), "prefill_ms": prefill_ms()}


def run_exec() -> int:
    log_event("start", worker=False)
    mode = mode_for(jobs_logged())
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
        pidfile = os.environ.get("FAKE_PROVIDER_PIDFILE")
        if pidfile:
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


def run_worker() -> int:
    log_event("start", worker=True)
    sock = socket.socket(fileno=int(os.environ["ONEBIT_PROVIDER_FD"]))

    def send(data: dict[str, Any]) -> None:
        sock.sendall(json.dumps(data).encode() + b"\n")

    if os.environ.get("FAKE_PROVIDER_READY") == "signal":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        log_event("waiting")
        signal.sigwait({signal.SIGUSR1})
    send({"ready": True})
    hung: dict[str, str] = {}  # job id -> its state file
    seen = 0
    with sock.makefile("rb") as lines:
        for raw in lines:
            message = json.loads(raw)
            if "cancel" in message:
                log_event("cancel", id=message["cancel"])
                Path(hung.pop(message["cancel"], "/nonexistent")).unlink(missing_ok=True)
                continue
            mode = mode_for(jobs_logged() if os.environ.get("FAKE_PROVIDER_LOG") else seen)
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


# -- for the tests that run this program -----------------------------------------------------------

PATH = Path(__file__)


def events(log: Path, event: str | None = None) -> list[dict[str, Any]]:
    """FAKE_PROVIDER_LOG's lines (only those of ``event`` when given); none before the first."""
    if not log.exists():
        return []
    found = [json.loads(raw) for raw in log.read_text().splitlines()]
    return [e for e in found if event is None or e["event"] == event]


def reaped(pid: int) -> bool:
    """No such process, not even a zombie: whoever started it has waited for it."""
    return not Path(f"/proc/{pid}").exists()


def gone(pid: int) -> bool:
    """The process has exited: no such pid, or a zombie its new parent has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def main() -> int:
    if sys.argv[1:] == ["--worker"]:
        return run_worker()
    if sys.argv[1:]:
        sys.exit("usage: fake_provider.py [--worker]")
    return run_exec()


if __name__ == "__main__":
    sys.exit(main())
