"""The prefix store in a directory the hosts share (``cache.shared_dir``): SharedPrefixStore.

The same store as :class:`~supervisor.prefix.store.PrefixStore` (lookup in memory, pins, puts that
take turns), with what another host can do in between: it is not locked; it reads the directory again
every ``cache.shared_rescan_s`` (:meth:`SharedPrefixStore.refresh`, which
supervisor/routes/stored.py's nursery calls) and before each write, for what other hosts stored,
used and evicted; its entries carry this host's ``server.host_id`` in their names; a put makes room
by evicting the least recently used entries of any host, and a removal goes through a tombstone so
that no two hosts delete under each other.  The names, the listing and the tombstone are
:mod:`supervisor.prefix.shared`'s.  Nothing here raises an ``OSError`` at its caller but
:meth:`SharedPrefixStore.open_shared` (whose caller then opens the private store).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio

from ..llama.llama_server import StateFingerprint
from . import files as prefix_files
from . import shared as shared_files
from .files import Disk, Entry
from .statistics import StoreStatistics
from .store import PrefixStore

log = logging.getLogger("onebit.prefix")

# A stat of a shared entry (NFS) answers in milliseconds; one this slow is a hung mount, and the
# request should prefill rather than wait for it.
SHARED_IO_TIMEOUT_S = 5.0
# A request whose prompt the index covers badly reads the directory again (another host may have
# just stored it: a drained host's hand-over) unless it was read this recently: a listing is a
# readdir and a stat per entry, far less than a long prompt's prefill, but not for every request.
RELIST_AFTER_S = 0.25
# How long a request waits for that listing: a healthy NFS lists hundreds of entries in well under
# a second; past this the request goes on with what is known.
RELIST_TIMEOUT_S = 1.0
# What the private fallback's statistics add to the shared store's.
_SUMMED = (
    *("entries", "bytes", "pinned", "hits", "misses", "evictions"),
    *("stores", "duplicates", "skipped", "store_failures", "drops"),
)


class SharedPrefixStore(PrefixStore):
    """Create with :meth:`open_shared`."""

    shared = True

    def __init__(
        self,
        directory: Path,
        *,
        host_id: str,
        fingerprint: StateFingerprint,
        max_bytes: int,
        min_tokens: int,
        max_age_s: float,
        disk: Disk,
    ) -> None:
        super().__init__(
            directory, fingerprint=fingerprint, max_bytes=max_bytes, min_tokens=min_tokens, disk=disk, host_id=host_id
        )
        self.max_age_s = max_age_s
        self._foreign: frozenset[str] = frozenset()  # others' entries of another fingerprint: never read again
        self._known: dict[str, Entry] = {}  # the snapshot a listing thread reads
        self._listed_at = float("-inf")  # trio clock of the last listing
        # The host's private store (cache.dir, locked as ever), set by supervisor/prefix/opening.py:
        # while the shared directory is unreachable, puts go there and lookups find them there.
        self.fallback: PrefixStore | None = None

    @classmethod
    async def open_shared(
        cls,
        directory: Path,
        *,
        host_id: str,
        fingerprint: StateFingerprint,
        max_bytes: int,
        min_tokens: int,
        max_age_s: float,
        disk: Disk | None = None,
    ) -> SharedPrefixStore:
        """The store in ``directory``, shared with other hosts: not locked; ``host_id`` names this
        host's files and entries; ``max_bytes`` bounds the directory, every host's entries together;
        an entry unused for ``max_age_s`` is evicted.  Raises OSError when the directory cannot be
        made, written or listed (the caller then opens the private store)."""
        disk = disk or Disk()
        directory = await trio.to_thread.run_sync(directory.absolute)
        await trio.to_thread.run_sync(prefix_files.probe, disk, directory, host_id)
        store = cls(
            directory,
            host_id=host_id,
            fingerprint=fingerprint,
            max_bytes=max_bytes,
            min_tokens=min_tokens,
            max_age_s=max_age_s,
            disk=disk,
        )
        async with store._write_lock:
            store._apply(await trio.to_thread.run_sync(store._listing))  # raises: the caller goes private
            store._listed_at = trio.current_time()
        others = sum(1 for entry in store._entries.values() if entry.origin_host != host_id)
        log.info(
            "prefix store: shared: %s as host %s: %d entries (%d of other hosts), %d bytes of %d for all hosts",
            directory,
            host_id,
            len(store._entries),
            others,
            store._bytes,
            max_bytes,
        )
        return store

    # -- the directory read again ----------------------------------------------------------------

    async def refresh(self) -> None:
        """Read the directory again for what other hosts stored, evicted or left; a directory that
        cannot be read now is logged once (lookups go on from what is known, and a restore of an
        entry that went with it fails into a prefill)."""
        async with self._write_lock:
            await self._refresh_locked()

    async def find(self, tokens: Sequence[int]) -> Entry | None:
        """:meth:`lookup`, after reading the directory again when the best entry known leaves at
        least ``min_tokens`` of the prompt to prefill, the last listing is older than
        :data:`RELIST_AFTER_S` and no write holds the directory (bounded: :data:`RELIST_TIMEOUT_S`);
        the private fallback's entry when it is longer."""
        # Degraded, the rescans alone look for the directory's return: not every request.
        if self._falls_short(tokens) and not self._write_lock.locked() and not self.degraded:
            with trio.move_on_after(RELIST_TIMEOUT_S):
                await self.refresh()
        found = self.lookup(tokens)
        private = self.fallback.peek(tokens) if self.fallback is not None else None
        if private is not None and (found is None or private.n_tokens > found.n_tokens):
            return private
        return found

    # -- the private store, while the shared directory is lost -----------------------------------

    @property
    def degraded(self) -> bool:
        """The shared directory is unreachable and the private store takes the puts."""
        return self.shared_problem is not None and self.fallback is not None and self.fallback.enabled

    def _fallbacks(self, entry: Entry) -> PrefixStore | None:
        """The private store, when ``entry`` is one of its own (its name carries no host)."""
        return self.fallback if self.fallback is not None and shared_files.host_of(entry.key) is None else None

    @asynccontextmanager
    async def exposed(self, entry: Entry, directory: Path) -> AsyncIterator[str]:
        private = self._fallbacks(entry)
        if private is not None:
            async with private.exposed(entry, directory) as name:
                yield name
        else:
            async with super().exposed(entry, directory) as name:
                yield name

    def drop(self, entry: Entry, reason: str = "refused by the decoder") -> None:
        private = self._fallbacks(entry)
        if private is not None:
            private.drop(entry, reason)
        else:
            super().drop(entry, reason)

    def wants(self, tokens: Sequence[int]) -> bool:
        if self.degraded:
            assert self.fallback is not None
            return self.fallback.wants(tokens)
        return super().wants(tokens)

    async def put_file(self, tokens: Sequence[int], path: Path) -> bool:
        if self.degraded:
            assert self.fallback is not None
            return await self.fallback.put_file(tokens, path)
        return await super().put_file(tokens, path)

    def statistics(self) -> StoreStatistics:
        """The shared store's, the private fallback's counts added (so counters only grow);
        ``shared`` is false while degraded."""
        own = super().statistics()
        if self.fallback is None:
            return own
        other = self.fallback.statistics()
        summed = {name: getattr(own, name) + getattr(other, name) for name in _SUMMED}
        return attrs.evolve(own, shared=not self.degraded, **summed)

    def list(self) -> list[Entry]:
        return [*super().list(), *(self.fallback.list() if self.fallback is not None else [])]

    async def clear(self) -> int:
        cleared = await super().clear()
        return cleared + (await self.fallback.clear() if self.fallback is not None else 0)

    def close(self) -> None:
        super().close()
        if self.fallback is not None:
            self.fallback.close()

    def _falls_short(self, tokens: Sequence[int]) -> bool:
        if len(tokens) < self.min_tokens or trio.current_time() - self._listed_at < RELIST_AFTER_S:
            return False
        best = self._index.longest_prefix(tokens)
        known = self._entries[best].n_tokens if best is not None else 0
        return len(tokens) - known >= self.min_tokens

    def _listing(self) -> shared_files.Listing:
        """In a worker thread: the directory's listing, against a snapshot of what we know."""
        assert self.directory is not None
        assert self.fingerprint is not None
        assert self.host_id is not None
        return shared_files.listing(
            self.directory,
            self.fingerprint.as_json(),
            known=self._known,
            foreign=self._foreign,
            host=self.host_id,
            max_age_s=self.max_age_s,
            now=time.time(),
        )

    async def _refresh_locked(self) -> shared_files.Listing | None:
        """Under the write lock: the listing applied to the index (None: the directory is lost)."""
        self._known = dict(self._entries)  # the worker thread reads a copy, never the live dict
        try:
            # Abandoned when a request stops waiting: the thread's listing is then thrown away.
            found = await trio.to_thread.run_sync(self._listing, abandon_on_cancel=True)
        except OSError as exc:
            if self.shared_problem is None:
                log.warning(
                    "prefix store: shared directory %s unreachable: %s; restores and stores fail into"
                    " prefills until it is back",
                    self.directory,
                    exc.strerror or exc,
                )
            self.shared_problem = f"unreachable: {exc.strerror or exc}"
            return None
        if self.shared_problem is not None:
            log.info("prefix store: shared directory %s reachable again", self.directory)
            self.shared_problem = None
        self._listed_at = trio.current_time()
        self._apply(found)
        return found

    def _apply(self, found: shared_files.Listing) -> None:
        """The index becomes what the listing found (our fingerprint's entries, of every host)."""
        for key in [key for key in self._entries if key not in found.entries]:
            self._vanished(key)  # another host evicted it
        self._entries = OrderedDict()
        for entry in sorted(found.entries.values(), key=lambda entry: entry.last_used):
            if entry.key in self._doomed:
                continue  # dropped here, removed at its last release
            self._entries[entry.key] = entry
            self._index.add(entry.key, entry.tokens)
        self._foreign = found.foreign
        self._bytes = found.bytes
        self._counts.evictions += found.aged
        self._counts.drops += found.cleaned

    # -- what another host may have done meanwhile -----------------------------------------------

    async def _still_there(self, key: str) -> bool:
        """Before a restore: whether the entry's state file is still there, recording the use (its
        mtime: how other hosts' evictions see it).  In a worker thread, bounded: a hung mount
        answers no, and the request prefills."""
        assert self.directory is not None
        path = prefix_files.state_path(self.directory, key)

        def touch() -> bool:
            try:
                os.utime(path)
            except FileNotFoundError:
                return False
            except OSError as exc:
                log.debug("prefix store: cannot record a use of %s: %s", key, exc.strerror or exc)
                return path.exists()
            return True

        with trio.move_on_after(SHARED_IO_TIMEOUT_S):
            return await trio.to_thread.run_sync(touch, abandon_on_cancel=True)
        log.warning("prefix store: %s did not answer in %g s; restoring nothing", self.directory, SHARED_IO_TIMEOUT_S)
        return False

    def _touch(self, key: str, when: float) -> None:
        """A use was recorded on disk by :meth:`_still_there`, off the trio thread."""

    def _remove_files(self, key: str) -> None:
        """Remove an entry's files, unless another host takes them first."""
        assert self.directory is not None
        assert self.host_id is not None
        shared_files.evict(self.directory, key, self.host_id)

    def _holds(self, key: str, tokens: Sequence[int]) -> bool:
        """Whether an entry for exactly ``tokens`` is stored, by any host (each host's has its own name)."""
        found = self._index.longest_prefix(tokens)
        return found is not None and self._entries[found].n_tokens == len(tokens)

    # -- filling it ------------------------------------------------------------------------------

    async def _commit(
        self, key: str, tokens: tuple[int, ...], path: Path, sidecar: bytes, state_bytes: int, created: float
    ) -> bool:
        """The directory read again, room made by evicting the least recently used entries of any
        host (each removed by one host only), then the entry under a name of this host's own."""
        assert self.directory is not None
        assert self.host_id is not None
        need = state_bytes + len(sidecar)
        found = await self._refresh_locked()
        if found is None:
            self._counts.store_failures += 1
            return False
        victims = shared_files.choose_victims(found.listed, need, self.max_bytes, set(self._pins))
        if need > self.max_bytes or victims is None:
            log.debug("prefix store: no room for %s (%d bytes)", key, need)
            self._counts.skipped += 1
            return False
        name = shared_files.entry_name(key, self.host_id)
        write = functools.partial(_evict_then_write, self._disk, self.directory, self.host_id, victims)
        try:
            evicted = await trio.to_thread.run_sync(write, name, path, sidecar, state_bytes)
        except OSError as exc:
            self._failed(key, exc)
            return False
        sizes = {item.name: item.disk_bytes for item in found.listed}
        for victim in victims:
            self._bytes -= sizes[victim]  # by us or by another host: gone either way
            self._vanished(victim)
        for victim in evicted:
            log.info("prefix store: evicting entry %s", victim)
            self._event("evicted", None)
        self._counts.evictions += len(evicted)
        self._stored(Entry(name, tokens, state_bytes, need, created, created, self.host_id))
        return True


def _evict_then_write(
    disk: Disk,
    directory: Path,
    host: str,
    victims: list[str],
    name: str,
    source: Path,
    sidecar: bytes,
    state_bytes: int,
) -> list[str]:
    """In a worker thread: evict (those another host took meanwhile are skipped), then write; the
    victims we removed ourselves."""
    evicted = [victim for victim in victims if shared_files.evict(directory, victim, host)]
    prefix_files.write_entry(disk, directory, name, source, sidecar, state_bytes)
    return evicted
