"""The prefix store: llama.cpp slot state files kept on disk, found again by token prefix.

A long prompt prefix costs the decoder seconds to prefill and llama-server milliseconds to save or
restore.  The store keeps saved states across decoder and onebitd restarts, within ``max_bytes``
(least recently used out first), for the decoder whose
:class:`~supervisor.llama.llama_server.StateFingerprint` made them.

- :meth:`PrefixStore.lookup` (pure, in memory): the longest entry that is a prefix of a prompt.
- :meth:`PrefixStore.exposed`: pins an entry and shows it under a fresh name in llama-server's
  ``--slot-save-path`` (a symlink into the store) for ``POST /slots/S?action=restore``.
- :meth:`PrefixStore.put_file`: takes a state file llama-server saved and commits it (off the
  request's path: the caller spawns it).  :meth:`PrefixStore.drop`: an entry the decoder refused.

Files and their guarantees are in :mod:`supervisor.prefix.files`.  A store the hosts share
(``cache.shared_dir``) is :mod:`supervisor.prefix.sharedstore`'s subclass.
The store's bookkeeping lives on the trio thread; only file work runs in worker threads, and writes
take turns (one lock), so what is on disk never exceeds ``max_bytes``.  Nothing here raises an
``OSError`` at its caller: a store that cannot work is disabled (one log line) and the daemon goes on
without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from ..errors import PrefixStoreError
from ..llama.llama_server import StateFingerprint
from . import files as prefix_files
from .files import Disk, Entry
from .index import PrefixIndex, token_key
from .statistics import Counts, StoreStatistics

__all__ = ["Entry", "PrefixStore", "StoreStatistics"]

log = logging.getLogger("onebit.prefix")

# A put waiting for the disk keeps its state file in llama-server's state directory, a tmpfs (memory):
# past this many puts in progress, a new one is refused rather than queued.
MAX_PENDING_PUTS = 3


class PrefixStore:
    """Create with :meth:`open` (or supervisor/prefix/opening.py's ``open_prefix_store``), or
    :meth:`disabled`; :meth:`close` when done.  A store the hosts share is
    supervisor/prefix/sharedstore.py's subclass."""

    shared = False  # a directory other hosts use too (the subclass)

    def __init__(
        self,
        directory: Path | None,
        *,
        fingerprint: StateFingerprint | None,
        max_bytes: int,
        min_tokens: int,
        disk: Disk,
        lock_fd: int | None = None,
        host_id: str | None = None,
        shared_problem: str | None = None,
    ) -> None:
        """``host_id``: written into each entry (its origin); ``shared_problem``: why the shared
        directory configured is not the one in use (or not usable now), for the statistics."""
        self.directory = directory
        self.host_id = host_id
        self.shared_problem = shared_problem
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self._disk = disk
        self._lock_fd = lock_fd
        self._index = PrefixIndex()
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self._pins: dict[str, int] = {}
        self._doomed: dict[str, Entry] = {}  # dropped while pinned: removed at the last release
        self._bytes = 0
        self._counts = Counts()
        self._write_lock = trio.Lock()
        self._pending: set[str] = set()  # keys of puts in progress, written or waiting their turn
        self._failing = False  # within a burst of failed writes: logged once
        # Told of each entry stored, evicted, dropped or restored, as it happens: the live feed's.
        self.on_event: Callable[[dict[str, Any]], None] = lambda event: None

    # -- opening and closing ---------------------------------------------------------------------

    @classmethod
    def disabled(cls, reason: str, *, level: int = logging.WARNING) -> PrefixStore:
        """A store that holds nothing: lookups miss, puts are refused, nothing raises."""
        log.log(level, "prefix store: off: %s", reason)
        return cls(None, fingerprint=None, max_bytes=0, min_tokens=0, disk=Disk())

    @classmethod
    async def open(
        cls,
        directory: Path,
        *,
        fingerprint: StateFingerprint,
        max_bytes: int,
        min_tokens: int,
        disk: Disk | None = None,
        host_id: str | None = None,
        shared_problem: str | None = None,
    ) -> PrefixStore:
        """The store in ``directory`` (made if need be), its entries checked against ``fingerprint``.

        Never raises for the file system: a directory that cannot be made, written or locked gives a
        :meth:`disabled` store.  Entries over ``max_bytes`` (a lowered setting) are evicted.
        """
        disk = disk or Disk()
        try:
            directory, lock_fd = await trio.to_thread.run_sync(prefix_files.lock, disk, directory)
        except OSError as exc:
            return cls.disabled(f"{directory}: {exc.strerror or exc}")
        store = cls(
            directory,
            fingerprint=fingerprint,
            max_bytes=max_bytes,
            min_tokens=min_tokens,
            disk=disk,
            lock_fd=lock_fd,
            host_id=host_id,
            shared_problem=shared_problem,
        )
        try:
            found = await trio.to_thread.run_sync(prefix_files.scan, directory, fingerprint.as_json())
        except OSError as exc:
            store.close()
            return cls.disabled(f"{directory}: cannot read it: {exc.strerror or exc}")
        for entry in found.entries:
            store._add(entry)
        store._counts.drops += found.dropped
        victims = store._choose_victims(0) or []  # max_bytes lowered since they were stored
        await trio.to_thread.run_sync(prefix_files.remove_all, directory, [victim.key for victim in victims])
        log.info(
            "prefix store: %s: %d entries, %d bytes of %d", directory, len(store._entries), store._bytes, max_bytes
        )
        return store

    def close(self) -> None:
        """Let go of the directory's lock (another onebitd may then open it).  Idempotent."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    # -- finding and using entries ---------------------------------------------------------------

    def lookup(self, tokens: Sequence[int]) -> Entry | None:
        """The longest entry whose tokens ``tokens`` starts with (the whole of it included), or None.

        Counts a hit or a miss.  Pure and in memory: no await, no file touched.
        """
        if not self.enabled:
            return None
        found = self.peek(tokens)
        if found is None:
            self._counts.misses += 1
        else:
            self._counts.hits += 1
        return found

    def peek(self, tokens: Sequence[int]) -> Entry | None:
        """:meth:`lookup` without counting it."""
        if not self.enabled:
            return None
        key = self._index.longest_prefix(tokens)
        return self._entries[key] if key is not None else None

    @asynccontextmanager
    async def exposed(self, entry: Entry, directory: Path) -> AsyncIterator[str]:
        """Pin ``entry`` and show it as a fresh file name in ``directory`` (llama-server's
        ``--slot-save-path``) for the block; the name is removed on the way out, whatever happens.

        Raises :class:`~supervisor.errors.PrefixStoreError` when the entry is gone (evicted or
        dropped since the lookup) or the name cannot be made.  Counts as a use for the LRU order.
        """
        if self.directory is None or entry.key not in self._entries:
            raise PrefixStoreError(f"prefix store entry {entry.key} is gone")
        key = entry.key
        if not await self._still_there(key):
            self._vanished(key)
            raise PrefixStoreError(f"prefix store entry {key} is gone (another host evicted it)")
        self._pins[key] = self._pins.get(key, 0) + 1
        try:
            name = f"prefix-{key[:16]}-{os.urandom(4).hex()}{prefix_files.STATE}"
            link = directory / name
            try:
                os.symlink(prefix_files.state_path(self.directory, key), link)
            except OSError as exc:
                raise PrefixStoreError(f"cannot expose prefix store entry {key}: {exc.strerror or exc}") from exc
            try:
                self._used(key)
                yield name
            finally:
                with contextlib.suppress(OSError):
                    link.unlink()
        finally:
            self._release(key)

    def drop(self, entry: Entry, reason: str = "refused by the decoder") -> None:
        """Forget ``entry`` (the decoder refused it, or its ``cache_n`` shows it was not used): no
        lookup returns it again; its files go now, or when the last :meth:`exposed` block ends.
        An entry already gone is ignored."""
        if self.directory is None or self._entries.get(entry.key) is None:
            return
        log.info("prefix store: dropping entry %s (%d tokens): %s", entry.key, entry.n_tokens, reason)
        self._counts.drops += 1
        self._event("dropped", entry, why=reason)
        self._forget(entry.key)

    def record_restore(self, ms: float, entry: Entry | None = None) -> None:
        """The caller timed a restore of ``entry`` (``POST /slots/S?action=restore``)."""
        self._counts.restores += 1
        if entry is not None and self.from_other_host(entry):
            self._counts.restores_other += 1
        self._counts.restore_ms_total += ms
        self._counts.restore_ms_last = ms
        self._event("restored", entry, ms=round(ms, 1))

    def _event(self, what: str, entry: Entry | None, **more: Any) -> None:
        """An entry's event for the feed: its size and origin, never its tokens."""
        if entry is not None:
            more.update(tokens=entry.n_tokens, bytes=entry.disk_bytes, origin_host=entry.origin_host)
        self.on_event({"what": what, **more})

    def from_other_host(self, entry: Entry) -> bool:
        """Whether another onebitd (another server.host_id) stored ``entry``."""
        return entry.origin_host is not None and entry.origin_host != self.host_id

    async def refresh(self) -> None:
        """A shared store reads its directory again (sharedstore.py); a private one knows it all."""

    async def find(self, tokens: Sequence[int]) -> Entry | None:
        """:meth:`lookup`, for a request: a shared store first reads its directory again when what it
        knows of the prompt falls short (sharedstore.py); a private one knows it all."""
        return self.lookup(tokens)

    async def _still_there(self, key: str) -> bool:
        """Before a restore: whether the entry is still on disk.  A private store's always is."""
        return True

    def _vanished(self, key: str) -> None:
        """Entry ``key`` went from the disk without us: forget it (its files are not ours to remove)."""
        if self._entries.pop(key, None) is not None:
            self._index.remove(key)

    def _touch(self, key: str, when: float) -> None:
        """Record a use on disk (best effort: the order in memory is what counts here)."""
        assert self.directory is not None
        prefix_files.touch(self.directory, key, when)

    def _remove_files(self, key: str) -> None:
        assert self.directory is not None
        prefix_files.remove(self.directory, key)

    def _holds(self, key: str, tokens: Sequence[int]) -> bool:
        """Whether an entry for exactly ``tokens`` (token key ``key``) is stored."""
        return key in self._entries

    # -- filling it ------------------------------------------------------------------------------

    def wants(self, tokens: Sequence[int]) -> bool:
        """Whether a state file for ``tokens`` is worth saving: the store is on, they are at least
        ``min_tokens`` long, not stored or being stored, and fewer than :data:`MAX_PENDING_PUTS`
        puts are in progress.  Pure; lets a caller skip ``?action=save``."""
        if not self.enabled or len(tokens) < self.min_tokens:
            return False
        if len(self._pending) >= MAX_PENDING_PUTS:
            return False
        try:
            key = token_key(tokens)
        except (OverflowError, TypeError):
            return False
        return not self._holds(key, tokens) and key not in self._pending

    async def put_file(self, tokens: Sequence[int], path: Path) -> bool:
        """Commit the state file at ``path`` as the entry for ``tokens``; True when the store holds
        such an entry afterwards (a duplicate is a no-op that returns True).

        ``tokens`` must be what the state file holds, or a prefix of it (a slot saved after a reply
        holds the generated tokens too).  The file is consumed: moved into the store, or removed.
        Never raises for the file system (ENOSPC and the like drop the entry, logged once per burst
        of failures); shielded from cancellation, so a started write finishes and is accounted.
        """
        stored = False
        with trio.CancelScope(shield=True):
            try:
                stored = await self._put(tuple(tokens), path)
            finally:
                prefix_files.discard(path)
        return stored

    async def _put(self, tokens: tuple[int, ...], path: Path) -> bool:
        if self.directory is None or self.fingerprint is None:
            return False
        if len(tokens) < self.min_tokens:
            self._counts.skipped += 1
            return False
        try:
            key = token_key(tokens)
        except (OverflowError, TypeError):
            log.warning("prefix store: refusing a put whose tokens are not llama.cpp tokens")
            self._counts.skipped += 1
            return False
        if self._holds(key, tokens) or key in self._pending:
            self._counts.duplicates += 1
            return True
        if len(self._pending) >= MAX_PENDING_PUTS:
            log.debug("prefix store: %d puts in progress; not storing %s", len(self._pending), key)
            self._counts.skipped += 1
            return False
        self._pending.add(key)
        try:
            async with self._write_lock:
                return await self._write_turn(key, tokens, path)
        finally:
            self._pending.discard(key)

    async def _write_turn(self, key: str, tokens: tuple[int, ...], path: Path) -> bool:
        """The put's turn at the disk (under the write lock)."""
        assert self.fingerprint is not None
        created = time.time()
        try:
            state_bytes = os.stat(path).st_size  # in the state directory, a tmpfs: no need for a thread
        except OSError as exc:
            self._failed(key, exc)
            return False
        sidecar = prefix_files.render_sidecar(tokens, self.fingerprint.as_json(), state_bytes, created, self.host_id)
        return await self._commit(key, tokens, path, sidecar, state_bytes, created)

    async def _commit(
        self, key: str, tokens: tuple[int, ...], path: Path, sidecar: bytes, state_bytes: int, created: float
    ) -> bool:
        """Room made (least recently used out), then the entry written: True when stored."""
        need = state_bytes + len(sidecar)
        victims = self._choose_victims(need) if need <= self.max_bytes else None
        if victims is None:
            log.debug("prefix store: no room for %s (%d bytes)", key, need)
            self._counts.skipped += 1
            return False
        try:
            await trio.to_thread.run_sync(self._write, victims, key, path, sidecar, state_bytes)
        except OSError as exc:
            self._failed(key, exc)
            return False
        self._stored(Entry(key, tokens, state_bytes, need, created, created, self.host_id))
        return True

    def _stored(self, entry: Entry) -> None:
        if self._failing:
            log.info("prefix store: storing works again")
            self._failing = False
        self._add(entry)
        self._counts.stores += 1
        self._event("stored", entry)

    def _write(self, victims: list[Entry], key: str, source: Path, sidecar: bytes, state_bytes: int) -> None:
        """In a worker thread: room first, then the new entry, so the disk never holds more than max_bytes."""
        assert self.directory is not None
        for victim in victims:
            prefix_files.remove(self.directory, victim.key)
        prefix_files.write_entry(self._disk, self.directory, key, source, sidecar, state_bytes)

    def _failed(self, key: str, exc: OSError) -> None:
        self._counts.store_failures += 1
        if not self._failing:
            log.warning("prefix store: cannot store %s: %s (further failures not logged)", key, exc.strerror or exc)
            self._failing = True

    # -- the bookkeeping (trio thread only) ------------------------------------------------------

    def _add(self, entry: Entry) -> None:
        self._entries[entry.key] = entry
        self._index.add(entry.key, entry.tokens)
        self._bytes += entry.disk_bytes

    def _used(self, key: str) -> None:
        assert self.directory is not None
        now = time.time()
        self._entries[key] = attrs.evolve(self._entries[key], last_used=now)
        self._entries.move_to_end(key)
        self._touch(key, now)

    def _forget(self, key: str) -> None:
        """Out of the index now; the files go now, or at the last release when pinned."""
        assert self.directory is not None
        entry = self._entries.pop(key)
        self._index.remove(key)
        if self._pins.get(key):
            self._doomed[key] = entry
        else:
            self._remove_files(key)
            self._bytes -= entry.disk_bytes

    def _release(self, key: str) -> None:
        self._pins[key] -= 1
        if self._pins[key]:
            return
        del self._pins[key]
        doomed = self._doomed.pop(key, None)
        if doomed is not None and self.directory is not None:
            self._remove_files(key)
            self._bytes -= doomed.disk_bytes

    def _choose_victims(self, need: int) -> list[Entry] | None:
        """Least recently used unpinned entries whose removal makes room for ``need`` more bytes,
        taken out of the index and the accounting now; None (and nothing taken) when pins prevent it."""
        if self._bytes + need <= self.max_bytes:
            return []
        victims: list[Entry] = []
        freed = 0
        for key, entry in self._entries.items():
            if self._pins.get(key):
                continue
            victims.append(entry)
            freed += entry.disk_bytes
            if self._bytes - freed + need <= self.max_bytes:
                break
        else:
            return None
        for victim in victims:
            log.info("prefix store: evicting entry %s (%d tokens)", victim.key, victim.n_tokens)
            del self._entries[victim.key]
            self._index.remove(victim.key)
            self._bytes -= victim.disk_bytes
            self._counts.evictions += 1
            self._event("evicted", victim)
        return victims

    # -- introspection, for onebitctl ------------------------------------------------------------

    def statistics(self) -> StoreStatistics:
        c = self._counts
        return StoreStatistics(
            enabled=self.enabled,
            directory=str(self.directory) if self.directory is not None else None,
            entries=len(self._entries),
            bytes=self._bytes,
            max_bytes=self.max_bytes,
            pinned=len(self._pins),
            hits=c.hits,
            misses=c.misses,
            evictions=c.evictions,
            stores=c.stores,
            duplicates=c.duplicates,
            skipped=c.skipped,
            store_failures=c.store_failures,
            drops=c.drops,
            restores=c.restores,
            restore_ms_mean=c.restore_ms_total / c.restores if c.restores else None,
            restore_ms_last=c.restore_ms_last,
            host_id=self.host_id,
            shared=self.shared,
            shared_problem=self.shared_problem,
            restores_other=c.restores_other,
        )

    def list(self) -> list[Entry]:
        """Every entry, most recently used first."""
        return list(reversed(self._entries.values()))

    async def clear(self) -> int:
        """Remove every entry (pinned ones when released); returns how many were removed."""
        if self.directory is None:
            return 0
        keys = list(self._entries)
        unpinned = [self._entries[key] for key in keys if not self._pins.get(key)]
        for key in keys:
            entry = self._entries.pop(key)
            self._index.remove(key)
            if self._pins.get(key):
                self._doomed[key] = entry
            else:
                self._bytes -= entry.disk_bytes
        with trio.CancelScope(shield=True):
            for entry in unpinned:
                await trio.to_thread.run_sync(self._remove_files, entry.key)
        log.info("prefix store: cleared %d entries", len(keys))
        return len(keys)
