"""A real ``worker`` provider for tests: one long-lived llama-server prefills every job and saves a
real llama.cpp slot state file, proving the worker contract end to end.

    llama_worker_provider.py LLAMA_SERVER STATE_DIR WORK_DIR [llama-server model args: -m ... -c ... -np ...]

Reads jobs as JSON lines from the socket in ``ONEBIT_PROVIDER_FD``, answers one claim line per job
(with its id), and says ``{"ready": true, "ping": true}`` once its llama-server is healthy.  A thread
reads the socket and answers each ``{"ping": n}`` with ``{"pong": n}`` at once, even while the main
thread runs a job (a prefill takes seconds), so onebitd's health checks see the worker itself: a
stopped or stuck reader is a missed pong.  Its llama-server is stopped and reaped when onebitd closes
the socket or the worker is told to stop.  Stdlib only.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from llama_exec_provider import call  # type: ignore[import-not-found]


def read(channel: socket.socket, send: Callable[[bytes], None], jobs: queue.SimpleQueue[bytes | None]) -> None:
    """The reading side: pings answered here, every other line queued in order; None at EOF."""
    try:
        for line in channel.makefile("rb"):
            try:
                message = json.loads(line)
            except ValueError:
                message = None  # the main thread's json.loads fails on it
            if isinstance(message, dict) and "ping" in message:
                send(json.dumps({"pong": message["ping"]}).encode() + b"\n")
            else:
                jobs.put(line)
    finally:
        jobs.put(None)


def main() -> int:
    binary, state_dir, work_dir, *model_args = sys.argv[1:]
    channel = socket.socket(fileno=int(os.environ["ONEBIT_PROVIDER_FD"]))
    # Under the test's own directory: whatever way this process ends, the test's clean-up removes it.
    with tempfile.TemporaryDirectory(prefix="wk-", dir=work_dir) as tmp:
        sock = os.path.join(tmp, "w.sock")
        server = subprocess.Popen(
            [binary, *model_args, "--host", sock, "--slot-save-path", state_dir, "--no-webui"],
            stdout=sys.stderr,
            stderr=sys.stderr,
        )

        def stop(_signum: int, _frame: FrameType | None) -> None:
            # No wait() here: the handler may run inside the main thread's own server.wait(), whose
            # lock it would then wait for forever.  Kill, clean up, leave; onebitd reaps the group.
            server.kill()
            shutil.rmtree(tmp, ignore_errors=True)
            os._exit(0)

        signal.signal(signal.SIGTERM, stop)
        try:
            deadline = time.monotonic() + 120
            while True:  # the worker polling its own child's health: not a test wait
                try:
                    if call(sock, "GET", "/health")[0] == 200:
                        break
                except OSError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    return 1
                time.sleep(0.05)
            sending = threading.Lock()

            def send(line: bytes) -> None:
                with sending:  # a pong and a claim, each one whole line
                    channel.sendall(line)

            send(b'{"ready": true, "ping": true}\n')
            jobs: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
            threading.Thread(target=read, args=(channel, send, jobs), daemon=True).start()
            while (line := jobs.get()) is not None:
                job = json.loads(line)
                if "cancel" in job:
                    continue
                status, done = call(
                    sock, "POST", "/completion", {"prompt": job["tokens"], "n_predict": 0, "id_slot": 0}
                )
                name = Path(job["state_file"]).name
                saved_status, saved = call(sock, "POST", "/slots/0?action=save", {"filename": name})
                if status != 200 or saved_status != 200 or not isinstance(done, dict) or not isinstance(saved, dict):
                    answer: dict[str, object] = {"id": job["id"], "error": f"prefill {status}, save {saved_status}"}
                else:
                    answer = {"id": job["id"], "n_tokens": saved["n_saved"], "prefill_ms": done["timings"]["prompt_ms"]}
                send(json.dumps(answer).encode() + b"\n")
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
