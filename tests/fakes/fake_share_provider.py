"""A stand-in prefill provider for the share route, and for the state-file route it falls back to.
Standard library only.

As an ``exec`` provider (no arguments) it reads one job from stdin; a share job's region fds are
inherited at the numbers in ``job["fds"]``.  With ``--worker`` it is a ``worker`` provider on the socket
whose fd is in ``ONEBIT_PROVIDER_FD``: ``{"ready": true}`` first, then one answer line per job; a share
job's fds arrive with its line (SCM_RIGHTS), in the order of ``job["fds"]``.

A share job: it maps the regions (``job["layout"]``, docs/protocol.md) and writes, for each position p
of the job's tokens and each tensor, the row :func:`expected_row` gives, which the fake llama-server
(tests/fakes/llama/share.py) checks on ``?action=adopt``.  A file job: it writes ``{"fake_state": true,
"tokens": [...]}`` to ``state_file``, which the fake decoder restores.  The claim is ``{"n_tokens", "prefill_ms"}``
(and ``state_rows`` with that mode).

Modes: the fields of :class:`Modes`, read from the ``share`` section of the control file
(tests/fakes/fake_control.py; tests write it with ``Control.set(share=Modes(...))``) for every job:

    short       write, and claim, one token fewer than the job has
    crash       write everything, then SIGKILL itself (a worker dies with its job)
    garbage     write everything; the last stdout line (worker: the answer) is not a claim; exit 0
    negative    write everything, claim n_tokens -1
    hang        write everything, then never answer (exec: wait to be killed; worker: until a cancel)
    state_rows  write a hybrid's recurrent state rows (kinds r, p, s: the row for the last token at the
                last position) and claim them (``state_rows``); without it they are left unwritten and
                unclaimed, as a provider written before the protocol had them does
    prefill_ms  the claimed prefill_ms (default 3.5)

Beside the control file it writes ``share.log``, one JSON line per event, {"event": "start" | "job" |
"cancel", "pid", ...} (a job's line has its id, route, n_tokens, fds, state_file and modes), and
``share.marker``, one line appended ("<pid> <job id> <route> <n>") once a job wrote its region or state
file, so a test can prove the provider ran and wrote.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import json
import mmap
import os
import signal
import socket
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __package__:  # imported by the tests (and so read by mypy)
    from tests.fakes import fake_control
else:  # run as a program: Python put this folder first on sys.path
    import fake_control

MODES = ("short", "crash", "garbage", "negative", "hang", "state_rows")
STATE_KINDS = ("r", "p", "s")
# Regions per job: the decoder lends one per backend buffer, a handful at most.
MAX_FDS = 64


def expected_row(token: int, pos: int, tensor: str, row_bytes: int) -> bytes:
    """The bytes for ``token`` at ``pos`` in ``tensor``: the token id, big-endian, then a hash of all
    three.  tests/fakes/llama/share.py has the same function; they must agree."""
    seed = f"{tensor}:{pos}:{token}".encode()
    digest = b""
    while len(digest) < row_bytes - 4:
        digest += hashlib.sha256(seed + len(digest).to_bytes(4, "big")).digest()
    return token.to_bytes(4, "big") + digest[: row_bytes - 4]


@dataclass(frozen=True)
class Modes:
    short: bool = False
    crash: bool = False
    garbage: bool = False
    negative: bool = False
    hang: bool = False
    state_rows: bool = False
    prefill_ms: float = 3.5

    @property
    def on(self) -> list[str]:
        return [m for m in MODES if getattr(self, m)]


def log_event(event: str, **fields: Any) -> None:
    fake_control.append(fake_control.log_path("share"), {"event": event, **fields})


def log_job(job: dict[str, Any], fds: list[int], modes: Modes) -> None:
    route, state_file = job.get("route"), job.get("state_file")
    log_event(
        "job", id=job["id"], route=route, n_tokens=len(job["tokens"]), fds=fds, state_file=state_file, modes=modes.on
    )


def write_region(job: dict[str, Any], fds: list[int], tokens: list[int], modes: Modes) -> int:
    """Write the K/V rows of ``tokens`` (and with ``state_rows``, the recurrent state rows); the
    number of state rows written."""
    layout = job["layout"]
    maps = [mmap.mmap(fd, region["size"]) for fd, region in zip(fds, layout["regions"], strict=True)]
    kv = [t for t in layout["tensors"] if t["kind"] not in STATE_KINDS]
    states = [t for t in layout["tensors"] if t["kind"] in STATE_KINDS] if modes.state_rows and tokens else []
    try:
        for pos, token in enumerate(tokens):
            for tensor in kv:
                row_bytes = tensor["row_bytes"]
                start = tensor["offset"] + pos * row_bytes
                maps[tensor["region"]][start : start + row_bytes] = expected_row(token, pos, tensor["name"], row_bytes)
        for tensor in states:
            row_bytes, start = tensor["row_bytes"], tensor["offset"]
            row = expected_row(tokens[-1], len(tokens) - 1, tensor["name"], row_bytes)
            maps[tensor["region"]][start : start + row_bytes] = row
    finally:
        for m in maps:
            m.close()
    return len(states)


def prefill(job: dict[str, Any], fds: list[int], modes: Modes) -> dict[str, Any]:
    """Write what the job asks for (less, when short); the claim to answer."""
    tokens = list(job["tokens"])
    if modes.short:
        tokens = tokens[:-1]
    claim: dict[str, Any] = {}
    if job.get("route") == "share":
        state_rows = write_region(job, fds, tokens, modes)
        if modes.state_rows:
            claim["state_rows"] = state_rows
    else:
        Path(job["state_file"]).write_text(json.dumps({"fake_state": True, "tokens": tokens}))
    marker = fake_control.beside(fake_control.MARKER)
    if marker is not None:
        fake_control.append_line(marker, f"{os.getpid()} {job['id']} {job.get('route')} {len(tokens)}")
    return {"n_tokens": -1 if modes.negative else len(tokens), "prefill_ms": modes.prefill_ms, **claim}


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def run_exec() -> int:
    log_event("start", worker=False)
    job = json.loads(sys.stdin.readline())
    modes = fake_control.modes("share", Modes)
    fds = list(job.get("fds", [])) if job.get("route") == "share" else []
    log_job(job, fds, modes)
    print(f"fake share provider: job {job['id']}: {len(job['tokens'])} tokens, modes {modes.on}", file=sys.stderr)
    claim = prefill(job, fds, modes)
    close_all(fds)
    if modes.crash:
        os.kill(os.getpid(), signal.SIGKILL)
    if modes.hang:
        while True:
            signal.pause()
    print(json.dumps({"n_tokens": 0, "progress": "starting"}), flush=True)  # a decoy: only the last line counts
    print("fake share provider: done, no claim today" if modes.garbage else json.dumps(claim), flush=True)
    return 0


class Lines:
    """Lines from the worker socket, each with the fds that arrived since the previous line."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.fds: deque[int] = deque()

    def __iter__(self) -> Lines:
        return self

    def __next__(self) -> dict[str, Any]:
        while b"\n" not in self.buffer:
            data, ancdata, _flags, _addr = self.sock.recvmsg(65536, socket.CMSG_SPACE(MAX_FDS * 4))
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    received = array.array("i")
                    received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
                    self.fds.extend(received)
            if not data:
                raise StopIteration
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        message: dict[str, Any] = json.loads(line)
        return message

    def take(self, n: int) -> list[int]:
        return [self.fds.popleft() for _ in range(n)]


def run_worker() -> int:
    log_event("start", worker=True)
    sock = socket.socket(fileno=int(os.environ["ONEBIT_PROVIDER_FD"]))

    def send(data: dict[str, Any]) -> None:
        sock.sendall(json.dumps(data).encode() + b"\n")

    send({"ready": True})
    hung: dict[str, list[int]] = {}  # job id -> the fds it holds
    lines = Lines(sock)
    for message in lines:
        if "cancel" in message:
            log_event("cancel", id=message["cancel"])
            close_all(hung.pop(message["cancel"], []))
            continue
        fds = lines.take(len(message.get("fds", []))) if message.get("route") == "share" else []
        modes = fake_control.modes("share", Modes)
        log_job(message, fds, modes)
        claim = prefill(message, fds, modes)
        if modes.crash:
            os.kill(os.getpid(), signal.SIGKILL)
        if modes.hang:
            hung[message["id"]] = fds
            continue
        close_all(fds)
        send({"note": "no claim here"} if modes.garbage else {"id": message["id"], **claim})
    return 0


PATH = Path(__file__)  # for the tests that run this program

if __name__ == "__main__":
    sys.exit(fake_control.provider_main(run_exec, run_worker))
