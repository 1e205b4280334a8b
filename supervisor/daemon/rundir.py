"""onebitd's runtime directory: its lock (one daemon per directory), and what a clean stop removes."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

from ..errors import RuntimeDirInUse
from ..models.model import Model
from ..supervise import lockfile

LOCK_NAME = "onebitd.lock"


def lock_runtime_dir(path: Path) -> int:
    """Hold ``onebitd.lock`` for our lifetime: a second daemon on the same directory would remove
    the first one's state files and sockets.  Returns the fd (the lock goes with the process)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        return lockfile.hold(path / LOCK_NAME)
    except lockfile.LockHeld as held:
        raise RuntimeDirInUse(
            f"server.runtime_dir: another onebitd (pid {held.holder}) is using {path}; "
            "give this one a runtime directory of its own"
        ) from None


def remove_own_files(runtime_dir: Path, models: Sequence[Model]) -> None:
    """A clean stop leaves the runtime directory as it found it: the children's sockets (they
    are stopped and reaped; llama-server leaves its socket file behind), the models' own empty
    directories and our lock go, and nothing else in the directory is touched.  The admin
    socket removes itself."""
    for model in models:
        for path in model.parts.sockets():
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        if model.dir != runtime_dir:
            with contextlib.suppress(OSError):
                (model.dir / "state").rmdir()
                model.dir.rmdir()
    with contextlib.suppress(OSError):
        (runtime_dir / LOCK_NAME).unlink(missing_ok=True)
