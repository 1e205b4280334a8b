"""A prefix store directory the hosts share (``cache.shared_dir``): SharedDirectory.

What another host can do in between is what sets it apart from the private directory: it is not
locked; each listing reads it again (:func:`supervisor.prefix.shared.listing`), for what other hosts
stored, used and evicted, and sizes every host's entries, of any fingerprint, for the one budget;
its entries carry this host's ``server.host_id`` in their names; a removal goes through a tombstone
so that no two hosts delete under each other; a use is recorded as the state file's mtime, which
other hosts' evictions read.  A directory that cannot be listed is said once, and again once it is
back.  Every call on the directory but the first listing is bounded or tolerant: a hung or lost
mount costs a request a prefill, never a wait.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import trio

from . import files as prefix_files
from . import shared as shared_files
from .directory import Listing
from .files import Disk, Entry

log = logging.getLogger("onebit.prefix")

# A stat of a shared entry (NFS) answers in milliseconds; one this slow is a hung mount, and the
# request should prefill rather than wait for it.
SHARED_IO_TIMEOUT_S = 5.0
# Reading a state file to check its content hash: 100 MiB over a 100 Mbit/s link take about 8 s;
# past this the mount is taken for hung and the request prefills.
VERIFY_TIMEOUT_S = 30.0


class SharedDirectory:
    """Create with :meth:`open`."""

    shared = True
    degraded = False

    def __init__(
        self,
        path: Path,
        *,
        host_id: str,
        fingerprint: Mapping[str, object],
        max_age_s: float,
        disk: Disk,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``max_age_s``: an entry no host used for this long, and a leftover this old, is removed.
        ``clock``: this host's, read only where the directory's own cannot be (:meth:`now`)."""
        self.path = path
        self.clock = clock
        self.host_id = host_id
        self._verified = prefix_files.Verified()
        self.max_age_s = max_age_s
        self.problem: str | None = None  # why the directory cannot be listed now
        self._fingerprint = fingerprint
        self._disk = disk
        self._foreign: frozenset[str] = frozenset()  # others' entries of another fingerprint: never read again

    @classmethod
    async def open(
        cls,
        path: Path,
        *,
        host_id: str,
        fingerprint: Mapping[str, object],
        max_age_s: float,
        disk: Disk,
        clock: Callable[[], float] = time.time,
    ) -> tuple[SharedDirectory, Listing]:
        """The directory made if need be, proven writable and listed, this host's own leftovers
        removed (none of its work is in progress yet): itself and what it holds.  Raises OSError
        when it cannot be made, written or listed."""
        path = await trio.to_thread.run_sync(path.absolute)
        await trio.to_thread.run_sync(prefix_files.probe, disk, path, host_id)
        directory = cls(path, host_id=host_id, fingerprint=fingerprint, max_age_s=max_age_s, disk=disk, clock=clock)
        found = await trio.to_thread.run_sync(directory._listing, {}, True)
        directory._foreign = found.foreign
        return directory, found

    def close(self) -> None:
        """Nothing is held: the directory is not locked."""

    def name(self, key: str) -> str:
        return shared_files.entry_name(key, self.host_id)

    async def list(self, known: Mapping[str, Entry]) -> Listing | None:
        """The directory as it is now, read in a worker thread (abandoned when the caller stops
        waiting); None when it cannot be listed, said once until it is back."""
        try:
            found = await trio.to_thread.run_sync(self._listing, dict(known), abandon_on_cancel=True)
        except OSError as exc:
            if self.problem is None:
                log.warning(
                    "prefix store: shared directory %s unreachable: %s; restores and stores fail into"
                    " prefills until it is back",
                    self.path,
                    exc.strerror or exc,
                )
            self.problem = f"unreachable: {exc.strerror or exc}"
            return None
        if self.problem is not None:
            log.info("prefix store: shared directory %s reachable again", self.path)
            self.problem = None
        self._foreign = found.foreign
        return found

    def _listing(self, known: Mapping[str, Entry], at_start: bool = False) -> Listing:
        """In a worker thread: the directory's listing, against a copy of what the store knows."""
        return shared_files.listing(
            self.path,
            self._fingerprint,
            known=known,
            foreign=self._foreign,
            host=self.host_id,
            max_age_s=self.max_age_s,
            now=self.now(),
            at_start=at_start,
        )

    def now(self) -> float:
        """The directory's clock (in a worker thread): the mtime the file system gives a file made
        now, as it gives the state files whose use a restore records (an NFS server stamps its own
        time), so that every host measures ages alike whatever its own clock says.  This host's
        clock where no file can be made."""
        path = self.path / f"{prefix_files.TEMP_PREFIX}clock-{self.host_id}~{os.getpid()}-{os.urandom(4).hex()}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, prefix_files.FILE_MODE)
        except OSError:
            return self.clock()
        try:
            return os.fstat(fd).st_mtime
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)

    async def use(self, name: str, when: float) -> bool:
        """Whether the entry's state file is still there (another host may have evicted it),
        recording the use as its mtime (now, by this host's clock), in a worker thread, bounded: a
        hung mount answers no."""
        path = self.state_path(name)

        def touch() -> bool:
            try:
                os.utime(path)
            except FileNotFoundError:
                return False
            except OSError as exc:
                log.debug("prefix store: cannot record a use of %s: %s", name, exc.strerror or exc)
                return path.exists()
            return True

        with trio.move_on_after(SHARED_IO_TIMEOUT_S):
            return await trio.to_thread.run_sync(touch, abandon_on_cancel=True)
        log.warning("prefix store: %s did not answer in %g s; restoring nothing", self.path, SHARED_IO_TIMEOUT_S)
        return False

    async def verify(self, name: str, blake2b: str) -> bool | None:
        """Bounded (:data:`VERIFY_TIMEOUT_S`): a hung mount answers None, and the request prefills."""
        with trio.move_on_after(VERIFY_TIMEOUT_S):
            return await trio.to_thread.run_sync(
                self._verified.matches, self.state_path(name), blake2b, abandon_on_cancel=True
            )
        log.warning("prefix store: %s did not answer in %g s; restoring nothing", self.path, VERIFY_TIMEOUT_S)
        return None

    def state_path(self, name: str) -> Path:
        return prefix_files.state_path(self.path, name)

    def write(self, name: str, source: Path, sidecar: bytes, state_bytes: int) -> None:
        prefix_files.write_entry(self._disk, self.path, name, source, sidecar, state_bytes)

    def remove(self, name: str) -> bool:
        """Through a tombstone: exactly one host removes an entry, whoever else chose it."""
        self._verified.forget(self.state_path(name))
        return shared_files.evict(self.path, name, self.host_id)
