"""A prefix store's private directory (``cache.dir``): PrivateDirectory.

One onebitd holds its lock (``.lock``), so nothing changes there without us: after the scan at open
(supervisor/prefix/files.py's, which removes what is not a committed entry), what the store knows
is what the directory holds, and a listing reads nothing.  Entries are named by their token key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import trio

from . import files as prefix_files
from .directory import Listed, Listing
from .files import Disk, Entry


class PrivateDirectory:
    """Create with :meth:`open`; the store (supervisor/prefix/store.py) closes it."""

    shared = False
    degraded = False

    def __init__(self, path: Path, *, disk: Disk, lock_fd: int, problem: str | None = None) -> None:
        """``problem``: why the shared directory configured is not the one in use (this host fell
        back to its private store at start)."""
        self.path = path
        self.problem = problem
        self._disk = disk
        self._lock_fd: int | None = lock_fd
        self._verified = prefix_files.Verified()

    @classmethod
    async def open(
        cls, path: Path, fingerprint: Mapping[str, object], *, disk: Disk, problem: str | None = None
    ) -> tuple[PrivateDirectory, Listing]:
        """The directory made if need be, locked and scanned: itself and its committed entries.
        Raises OSError when it cannot be made, written, locked or read."""
        path, lock_fd = await trio.to_thread.run_sync(prefix_files.lock, disk, path)
        directory = cls(path, disk=disk, lock_fd=lock_fd, problem=problem)
        try:
            found = await trio.to_thread.run_sync(prefix_files.scan, path, fingerprint)
        except OSError as exc:
            directory.close()
            raise OSError(exc.errno, f"cannot read it: {exc.strerror or exc}") from exc
        entries = {entry.key: entry for entry in found.entries}
        return directory, Listing(entries, _listed(entries), cleaned=found.dropped)

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def name(self, key: str) -> str:
        return key

    async def list(self, known: Mapping[str, Entry]) -> Listing:
        """What the store knows, as it knows it: no one else writes here."""
        return Listing(dict(known), _listed(known))

    async def use(self, name: str, when: float) -> bool:
        # A local file system: a utime needs no thread.
        prefix_files.touch(self.path, name, when)
        return True

    async def verify(self, name: str, blake2b: str) -> bool:
        return await trio.to_thread.run_sync(self._verified.matches, self.state_path(name), blake2b)

    def state_path(self, name: str) -> Path:
        return prefix_files.state_path(self.path, name)

    def write(self, name: str, source: Path, sidecar: bytes, state_bytes: int) -> None:
        prefix_files.write_entry(self._disk, self.path, name, source, sidecar, state_bytes)

    def remove(self, name: str) -> bool:
        self._verified.forget(self.state_path(name))
        prefix_files.remove(self.path, name)
        return True


def _listed(entries: Mapping[str, Entry]) -> list[Listed]:
    """The budget's view of ``entries``, in their order (the store's: least recently used first)."""
    return [Listed(entry.key, entry.disk_bytes, entry.last_used, True) for entry in entries.values()]
