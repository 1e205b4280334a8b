"""An exclusive lock file held for a process's life: one onebitd per runtime directory, one per
prefix store.  ``flock`` goes with the file descriptor, so a daemon that dies, however it dies,
leaves the lock free for the next one."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class LockHeld(OSError):
    """Another process holds the lock; ``holder``: the pid it wrote, or ``?``."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by pid {holder}")
        self.holder = holder


def hold(path: Path) -> int:
    """Create ``path`` if it is not there, take its lock without waiting and write our pid in it:
    the fd that holds the lock (closing it frees the lock).  Raises :class:`LockHeld`, or the
    ``OSError`` of a file that cannot be made."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise LockHeld(path, holder) from None
    except OSError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
