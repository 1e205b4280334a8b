"""tests/rigs/llama_exec_provider.py, the real exec provider the real-parts tests run, leaves nothing
behind when onebitd stops a cancelled job with SIGTERM: its llama-server is stopped and its
temporary directory removed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import trio

from tests.rigs.rig import TESTS


async def test_sigterm_stops_its_llama_server_and_removes_its_directory(tmp_path: Path) -> None:
    # A stand-in llama-server that says where its socket would be, then never comes up.
    server = tmp_path / "llama-server"
    server.write_text('#!/bin/sh\necho "pid $$ args $*" >&2\nexec sleep 300\n')
    server.chmod(0o700)
    job = {"state_file": str(tmp_path / "state" / "job.bin"), "tokens": [1, 2, 3]}
    with trio.fail_after(30):
        process = await trio.lowlevel.open_process(
            [sys.executable, str(TESTS / "rigs" / "llama_exec_provider.py"), str(server)],
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        pid: str | None = None
        try:
            assert process.stdin is not None
            assert process.stderr is not None
            await process.stdin.send_all(json.dumps(job).encode() + b"\n")
            seen = b""
            while b"\n" not in seen:
                chunk = await process.stderr.receive_some()
                assert chunk, "it exited before starting its llama-server"
                seen += chunk
            args = seen.decode().split("\n")[0].split()
            directory, pid = trio.Path(args[args.index("--host") + 1]).parent, args[1]
            assert await directory.is_dir()
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 128 + signal.SIGTERM
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            if pid is not None and await trio.Path(f"/proc/{pid}").exists():
                os.kill(int(pid), signal.SIGKILL)  # the stand-in we started, left by a failing run
    assert not await directory.exists()
    # Its stand-in llama-server was stopped and reaped too.
    assert not await trio.Path(f"/proc/{pid}").exists()
