"""A real ``worker`` provider for tests: one long-lived llama-server prefills every job and saves a
real llama.cpp slot state file, proving the worker contract end to end.

    llama_worker_provider.py LLAMA_SERVER STATE_DIR WORK_DIR [llama-server model args: -m ... -c ... -np ...]

Reads jobs as JSON lines from the socket in ``ONEBIT_PROVIDER_FD``, answers one claim line per job
(with its id), and says ``{"ready": true}`` once its llama-server is healthy.  Its llama-server is
stopped and reaped when onebitd closes the socket or the worker is told to stop.  Stdlib only.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from llama_exec_provider import call  # type: ignore[import-not-found]


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
            channel.sendall(b'{"ready": true}\n')
            for line in channel.makefile("rb"):
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
                channel.sendall(json.dumps(answer).encode() + b"\n")
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
