"""A stand-in prefill provider for the share route, and for the state-file route it falls back to.
Standard library only.

As an ``exec`` provider (no arguments) it reads one job from stdin; a share job's region fds are
inherited at the numbers in ``job["fds"]``.  With ``--worker`` it is a ``worker`` provider on the socket
whose fd is in ``ONEBIT_PROVIDER_FD``: ``{"ready": true}`` first, then one answer line per job; a share
job's fds arrive with its line (SCM_RIGHTS), in the order of ``job["fds"]``.

A share job: it maps the regions (``job["layout"]``, docs/protocol.md) and writes, for each position p
of the job's tokens and each tensor, the row :func:`expected_row` gives, which tests/fake_decoder.py
checks on ``?action=adopt``.  A file job: it writes ``{"fake_state": true, "tokens": [...]}`` to
``state_file``, which the fake decoder restores.  The claim is ``{"n_tokens", "prefill_ms"}``.

Modes, each an environment variable ``FAKE_KVSHARE_<NAME>=1``, or the key ``<name>`` (lower case) in the
JSON file named by ``FAKE_KVSHARE_CONTROL``, read again for every job (the file wins):

    short     write, and claim, one token fewer than the job has
    crash     write everything, then SIGKILL itself (a worker dies with its job)
    garbage   write everything; the last stdout line (worker: the answer) is not a claim; exit 0
    negative  write everything, claim n_tokens -1
    hang      write everything, then never answer (exec: wait to be killed; worker: until a cancel)

    FAKE_KVSHARE_MARKER  a file: one line appended ("<pid> <job id> <route> <n>") once a job wrote
                         its region or state file, so a test can prove the provider ran and wrote
    FAKE_KVSHARE_LOG     a file: one JSON line per event, {"event": "start" | "job" | "cancel", "pid",
                         ...}; a job's line has its id, route, n_tokens, fds, state_file and modes
    FAKE_KVSHARE_PREFILL_MS  the claimed prefill_ms (default 3.5)
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
from pathlib import Path
from typing import Any

MODES = ("short", "crash", "garbage", "negative", "hang")
# Regions per job: the decoder lends one per backend buffer, a handful at most.
MAX_FDS = 64


def expected_row(token: int, pos: int, tensor: str, row_bytes: int) -> bytes:
    """The bytes for ``token`` at ``pos`` in ``tensor``: the token id, big-endian, then a hash of all
    three.  tests/fake_decoder.py has the same function; they must agree."""
    seed = f"{tensor}:{pos}:{token}".encode()
    digest = b""
    while len(digest) < row_bytes - 4:
        digest += hashlib.sha256(seed + len(digest).to_bytes(4, "big")).digest()
    return token.to_bytes(4, "big") + digest[: row_bytes - 4]


def modes() -> set[str]:
    on = {m for m in MODES if os.environ.get(f"FAKE_KVSHARE_{m.upper()}", "").strip() not in ("", "0")}
    control = os.environ.get("FAKE_KVSHARE_CONTROL")
    if control:
        try:
            data = json.loads(Path(control).read_text())
        except (OSError, ValueError):
            data = None
        if isinstance(data, dict):
            on = {m for m in MODES if data.get(m, m in on)}
    return on


def log_event(event: str, **fields: Any) -> None:
    path = os.environ.get("FAKE_KVSHARE_LOG")
    if path:
        _append(path, json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n")


def _append(path: str, line: str) -> None:
    # One write on an O_APPEND descriptor: lines from several processes never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def write_region(job: dict[str, Any], fds: list[int], tokens: list[int]) -> None:
    layout = job["layout"]
    maps = [mmap.mmap(fd, region["size"]) for fd, region in zip(fds, layout["regions"], strict=True)]
    try:
        for pos, token in enumerate(tokens):
            for tensor in layout["tensors"]:
                row_bytes = tensor["row_bytes"]
                start = tensor["offset"] + pos * row_bytes
                maps[tensor["region"]][start : start + row_bytes] = expected_row(token, pos, tensor["name"], row_bytes)
    finally:
        for m in maps:
            m.close()


def prefill(job: dict[str, Any], fds: list[int], on: set[str]) -> dict[str, Any]:
    """Write what the job asks for (less, when short); the claim to answer."""
    tokens = list(job["tokens"])
    if "short" in on:
        tokens = tokens[:-1]
    if job.get("route") == "share":
        write_region(job, fds, tokens)
    else:
        Path(job["state_file"]).write_text(json.dumps({"fake_state": True, "tokens": tokens}))
    marker = os.environ.get("FAKE_KVSHARE_MARKER")
    if marker:
        _append(marker, f"{os.getpid()} {job['id']} {job.get('route')} {len(tokens)}\n")
    prefill_ms = float(os.environ.get("FAKE_KVSHARE_PREFILL_MS", "3.5"))
    return {"n_tokens": -1 if "negative" in on else len(tokens), "prefill_ms": prefill_ms}


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def run_exec() -> int:
    log_event("start", worker=False)
    job = json.loads(sys.stdin.readline())
    on = modes()
    fds = list(job.get("fds", [])) if job.get("route") == "share" else []
    log_event(
        "job",
        id=job["id"],
        route=job.get("route"),
        n_tokens=len(job["tokens"]),
        fds=fds,
        state_file=job.get("state_file"),
        modes=sorted(on),
    )
    print(f"fake share provider: job {job['id']}: {len(job['tokens'])} tokens, modes {sorted(on)}", file=sys.stderr)
    claim = prefill(job, fds, on)
    close_all(fds)
    if "crash" in on:
        os.kill(os.getpid(), signal.SIGKILL)
    if "hang" in on:
        while True:
            signal.pause()
    print(json.dumps({"n_tokens": 0, "progress": "starting"}), flush=True)  # a decoy: only the last line counts
    print("fake share provider: done, no claim today" if "garbage" in on else json.dumps(claim), flush=True)
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
        on = modes()
        log_event(
            "job",
            id=message["id"],
            route=message.get("route"),
            n_tokens=len(message["tokens"]),
            fds=fds,
            state_file=message.get("state_file"),
            modes=sorted(on),
        )
        claim = prefill(message, fds, on)
        if "crash" in on:
            os.kill(os.getpid(), signal.SIGKILL)
        if "hang" in on:
            hung[message["id"]] = fds
            continue
        close_all(fds)
        send({"note": "no claim here"} if "garbage" in on else {"id": message["id"], **claim})
    return 0


# -- for the tests that run this program -----------------------------------------------------------

PATH = Path(__file__)


def events(log: Path, event: str | None = None) -> list[dict[str, Any]]:
    """FAKE_KVSHARE_LOG's lines (only those of ``event`` when given); none before the first."""
    if not log.exists():
        return []
    found = [json.loads(raw) for raw in log.read_text().splitlines()]
    return [e for e in found if event is None or e["event"] == event]


def main() -> int:
    if sys.argv[1:] == ["--worker"]:
        return run_worker()
    if sys.argv[1:]:
        sys.exit("usage: fake_share_provider.py [--worker]")
    return run_exec()


if __name__ == "__main__":
    sys.exit(main())
