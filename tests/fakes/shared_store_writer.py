"""A host that stores one entry into a shared prefix store and stops dead half way through a file of
it, for tests/unit/prefix/test_shared_store.py to SIGKILL there.

    python -m tests.fakes.shared_store_writer SHARED_DIR STATE_FILE state|sidecar

It writes half of the state file's copy (``state``) or of the sidecar (``sidecar``), fsyncs that
half, prints ``stuck`` and waits to be killed.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import trio

from supervisor.prefix.files import Disk
from supervisor.prefix.opening import open_shared
from tests.unit.prefix.test_prefix_store import FINGERPRINT, tokens

STUCK = "stuck"


def stop_dead() -> None:
    print(STUCK, flush=True)
    while True:
        time.sleep(60)


class StuckDisk(Disk):
    def __init__(self, where: str) -> None:
        self.where = where

    def move_in(self, source: Path, target: Path) -> None:
        if self.where != "state":
            super().move_in(source, target)
            return
        data = source.read_bytes()
        with open(target, "wb") as out:
            out.write(data[: len(data) // 2])
            out.flush()
            os.fsync(out.fileno())
        stop_dead()

    def write(self, target: Path, data: bytes) -> None:
        if self.where != "sidecar" or target.name.startswith(".tmp-probe"):
            super().write(target, data)
            return
        with open(target, "wb") as out:
            out.write(data[: len(data) // 2])
            out.flush()
            os.fsync(out.fileno())
        stop_dead()


async def main(shared_dir: Path, state_file: Path, where: str) -> None:
    store = await open_shared(
        shared_dir,
        host_id="doomed",
        fingerprint=FINGERPRINT,
        max_bytes=1 << 30,
        min_tokens=8,
        max_age_s=86400.0,
        disk=StuckDisk(where),
    )
    await store.put_file(tokens(100), state_file)


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
