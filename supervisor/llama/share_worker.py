"""A ``worker`` prefill provider for the share route that needs no patched provider: a stock
llama-server prefills, saves its slot to a file on tmpfs, and this program copies each position's K and
V rows out of that file into the region the decoder lent.

    python -m supervisor.llama.share_worker LLAMA_SERVER [llama-server model args: -m ... -c ... -np ... -fa ...]

The model arguments must be the decoder's (``-m``, ``-c``, ``-np``, ``-b``, ``-ub``, ``-ctk``, ``-ctv``):
the rows are only the decoder's rows when both caches are alike.  The worker contract is docs/protocol.md's
(``ONEBIT_PROVIDER_FD``, one JSON line each way, ``{"ready": true}`` first); it serves file jobs too (the
share route falls back to them), by moving the saved file to ``state_file``.

The slot state file it reads and the copy into the lent region are supervisor/llama/region.py's.
"""

from __future__ import annotations

import array
import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from .region import JobRefused, StateReader, read_prompt, write_saved_state

# Regions per job: one per slot today; more than this is not a layout.
_MAX_FDS = 64
# The worker's own llama-server answers a local prefill within this, or is broken.
_HTTP_TIMEOUT_S = 600.0
# A llama-server loads the default model in seconds; a big model on a slow disk, in a minute or two.
_START_TIMEOUT_S = 300.0


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=_HTTP_TIMEOUT_S)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(_HTTP_TIMEOUT_S)
        sock.connect(self.unix_path)
        self.sock = sock


def call(path: str, method: str, url: str, body: object | None = None) -> tuple[int, Any]:
    conn = _UnixHTTPConnection(path)
    try:
        conn.request(method, url, body=None if body is None else json.dumps(body))
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


class Channel:
    """The socket to onebitd: job lines in, with the share jobs' fds (SCM_RIGHTS) kept in arrival order."""

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.buffer = b""
        self.fds: deque[int] = deque()

    def lines(self) -> Iterator[dict[str, Any]]:
        while True:
            while b"\n" not in self.buffer:
                data, ancdata, _flags, _addr = self.sock.recvmsg(
                    65536, socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize)
                )
                for level, kind, payload in ancdata:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        got = array.array("i")
                        got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                        self.fds.extend(got)
                if not data:
                    return
                self.buffer += data
            line, self.buffer = self.buffer.split(b"\n", 1)
            if line.strip():
                job = json.loads(line)
                if isinstance(job, dict):
                    yield job

    def take_fds(self, n: int) -> list[int]:
        if len(self.fds) < n:
            raise JobRefused(f"the job names {n} region fds, {len(self.fds)} came with it")
        return [self.fds.popleft() for _ in range(n)]

    def send(self, answer: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(answer).encode() + b"\n")


class Worker:
    def __init__(self, server_socket: str, save_dir: Path) -> None:
        self.server_socket = server_socket
        self.save_dir = save_dir

    def _prefill_and_save(self, job: dict[str, Any], name: str) -> tuple[float, Path]:
        status, done = call(
            self.server_socket, "POST", "/completion", {"prompt": job["tokens"], "n_predict": 0, "id_slot": 0}
        )
        if status != 200 or not isinstance(done, dict):
            raise JobRefused(f"prefill answered {status}: {json.dumps(done)[:200]}")
        status, saved = call(self.server_socket, "POST", "/slots/0?action=save", {"filename": name})
        if status != 200 or not isinstance(saved, dict):
            raise JobRefused(f"save answered {status}: {json.dumps(saved)[:200]}")
        return float(done.get("timings", {}).get("prompt_ms", 0.0)), self.save_dir / name

    def file_job(self, job: dict[str, Any]) -> dict[str, Any]:
        prefill_ms, path = self._prefill_and_save(job, f"file-{os.getpid()}.state")
        try:
            # The decoder restores the file whatever its cells look like (a transposed V included):
            # only the prompt is read here, for the claim.
            with path.open("rb") as file:
                tokens = read_prompt(StateReader(file.read(1 << 20)))
            shutil.move(path, job["state_file"])
        finally:
            path.unlink(missing_ok=True)
        return {"n_tokens": len(tokens), "prefill_ms": prefill_ms}

    def share_job(self, job: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        prefill_ms, path = self._prefill_and_save(job, f"share-{os.getpid()}.state")
        try:
            written = write_saved_state(path, job["tokens"], job["layout"], fds)
        finally:
            path.unlink(missing_ok=True)
        return {**written.claim(), "prefill_ms": prefill_ms}


def _save_dir(parent: str) -> tempfile.TemporaryDirectory[str]:
    # tmpfs when there is one: the state file is written and read once, never kept.
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else parent
    return tempfile.TemporaryDirectory(prefix="onebit-share-", dir=base)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        print("usage: python -m supervisor.llama.share_worker LLAMA_SERVER [llama-server model args]", file=sys.stderr)
        return 2
    binary, *model_args = args
    channel = Channel(int(os.environ["ONEBIT_PROVIDER_FD"]))
    # The worker's own llama-server is a stock one: its KV stays where llama.cpp puts it.
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_KV_SHARE", "ONEBIT_PROVIDER_FD")}
    with tempfile.TemporaryDirectory(prefix="onebit-sw-") as tmp, _save_dir(tmp) as save:
        server_socket = os.path.join(tmp, "llama.sock")
        server = subprocess.Popen(
            [binary, *model_args, "--host", server_socket, "--slot-save-path", save + "/", "--no-webui"],
            stdout=sys.stderr,
            stderr=sys.stderr,
            env=env,
        )

        def stop(_signum: int, _frame: FrameType | None) -> None:
            # No wait() here: the handler may run inside the main thread's own server.wait().  Kill,
            # clean up, leave; onebitd reaps our process group.
            server.kill()
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(save, ignore_errors=True)
            os._exit(0)

        signal.signal(signal.SIGTERM, stop)
        try:
            deadline = time.monotonic() + _START_TIMEOUT_S
            while True:  # polling our own child's health: a start-up gate, not a wait for a condition we cause
                with contextlib.suppress(OSError, ValueError):
                    if call(server_socket, "GET", "/health")[0] == 200:
                        break
                if server.poll() is not None or time.monotonic() > deadline:
                    print("share_worker: llama-server did not become healthy", file=sys.stderr)
                    return 1
                time.sleep(0.05)
            worker = Worker(server_socket, Path(save))
            channel.send({"ready": True})
            for job in channel.lines():
                if "cancel" in job:
                    continue  # one job at a time: a cancelled one has already been answered
                answer: dict[str, Any] = {"id": job.get("id")}
                fds: list[int] = []
                try:
                    if job.get("route") == "share":
                        fds = channel.take_fds(len(job.get("fds", [])))
                        answer.update(worker.share_job(job, fds))
                    else:
                        answer.update(worker.file_job(job))
                except (JobRefused, OSError, KeyError, TypeError, ValueError) as exc:
                    answer["error"] = f"{type(exc).__name__}: {exc}" if not isinstance(exc, JobRefused) else str(exc)
                finally:
                    for fd in fds:
                        os.close(fd)
                channel.send(answer)
            return 0
        finally:
            server.terminate()
            try:
                server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


if __name__ == "__main__":
    sys.exit(main())
