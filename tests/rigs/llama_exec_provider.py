"""A real ``exec`` provider for tests: it prefills with a llama-server of its own and writes a real
llama.cpp slot state file, proving the exec contract end to end.

    llama_exec_provider.py LLAMA_SERVER [llama-server model args: -m ... -c ... -np ...]

Reads the job from stdin, starts the given llama-server on a private unix socket with
``--slot-save-path`` set to the state file's directory, prefills the job's tokens with
``n_predict: 0``, saves slot 0 under the state file's name, prints the claim and exits 0.  Its
llama-server is always stopped and reaped before it exits, and its socket's directory removed: on
SIGTERM too (onebitd's stop of a cancelled job, given a ``kill_grace_s``).  Stdlib only.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=120)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(120)
        sock.connect(self.unix_path)
        self.sock = sock


def call(path: str, method: str, url: str, body: object | None = None) -> tuple[int, object]:
    conn = UnixHTTPConnection(path)
    try:
        conn.request(method, url, body=None if body is None else json.dumps(body))
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def stop(signum: int, _frame: object) -> None:
    """SIGTERM unwinds like an exception: the finally blocks stop the llama-server and remove the
    temporary directory."""
    raise SystemExit(128 + signum)


def unblock_sigterm() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def main() -> int:
    signal.signal(signal.SIGTERM, stop)
    binary, *model_args = sys.argv[1:]
    job = json.loads(sys.stdin.readline())
    state_file = Path(job["state_file"])
    with tempfile.TemporaryDirectory(prefix="ob-exec-", dir="/tmp") as tmp:
        sock = os.path.join(tmp, "p.sock")
        # SIGTERM held back until ``server`` is known: one that came while Popen ran (after the child
        # started, before Popen returned) would unwind past the finally that stops it.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        server = subprocess.Popen(
            [binary, *model_args, "--host", sock, "--slot-save-path", str(state_file.parent), "--no-webui"],
            stdout=sys.stderr,
            stderr=sys.stderr,
            preexec_fn=unblock_sigterm,  # the child's own SIGTERM as usual
        )
        try:
            unblock_sigterm()
            deadline = time.monotonic() + 120
            while True:  # a provider program polling its own child's health: not a test wait
                try:
                    if call(sock, "GET", "/health")[0] == 200:
                        break
                except OSError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    print("llama-server did not come up", file=sys.stderr)
                    return 1
                time.sleep(0.05)
            status, done = call(sock, "POST", "/completion", {"prompt": job["tokens"], "n_predict": 0, "id_slot": 0})
            if status != 200:
                print(f"prefill answered {status}: {done}", file=sys.stderr)
                return 1
            status, saved = call(sock, "POST", "/slots/0?action=save", {"filename": state_file.name})
            if status != 200:
                print(f"save answered {status}: {saved}", file=sys.stderr)
                return 1
            assert isinstance(done, dict)
            assert isinstance(saved, dict)
            print(json.dumps({"n_tokens": saved["n_saved"], "prefill_ms": done["timings"]["prompt_ms"]}))
            return 0
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    sys.exit(main())
