"""The prefix store: llama.cpp slot state files kept on disk, found again by token prefix.

A long prompt prefix costs the decoder seconds to prefill and llama-server milliseconds to save or
restore.  The store keeps saved states across decoder and onebitd restarts, within ``max_bytes``
(least recently used out first), for the decoder whose
:class:`~supervisor.llama.llama_server.StateFingerprint` made them.

- :meth:`PrefixStore.lookup` (pure, in memory): the longest entry that is a prefix of a prompt;
  :meth:`PrefixStore.find`, for a request, lists a shared directory again first when that may help.
- :meth:`PrefixStore.exposed`: pins an entry and shows it under a fresh name in llama-server's
  ``--slot-save-path`` (a symlink into the store) for ``POST /slots/S?action=restore``.
- :meth:`PrefixStore.put_file`: takes a state file llama-server saved and commits it (off the
  request's path: the caller spawns it).  :meth:`PrefixStore.drop`: an entry the decoder refused.

The store is bookkeeping over a directory: what it holds (the entries in LRU order, their index,
the pins: supervisor/prefix/ledger.py's :class:`~supervisor.prefix.ledger.Ledger`), the puts in
progress and the counts, on the trio thread.  It touches no file: what it asks of the disk goes
through its :class:`~supervisor.prefix.directory.Directory` (private, shared, or the fallback
between them), whose file work runs in worker threads; writes take turns (one lock), and each
first lists the directory and makes room, so what is on disk stays within ``max_bytes``.  Nothing
here raises an ``OSError`` at its caller.  A store that is off is no store: its callers hold None.
How a store is opened is supervisor/prefix/opening.py's; the design, supervisor/prefix/design.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from ..errors import PrefixStoreError
from ..llama.llama_server import StateFingerprint
from . import files as prefix_files
from .background import Background
from .directory import Directory, Listing
from .files import Entry
from .index import token_key
from .ledger import Ledger
from .shared import choose_victims
from .statistics import Counts, StoreStatistics

__all__ = ["Entry", "PrefixStore", "StoreStatistics"]

log = logging.getLogger("onebit.prefix")

# A put waiting for the disk keeps its state file in llama-server's state directory, a tmpfs (memory):
# past this many puts in progress, a new one is refused rather than queued.
MAX_PENDING_PUTS = 3
# A request whose prompt the index covers badly lists a shared directory again (another host may
# have just stored it: a drained host's hand-over) unless it was listed this recently: a listing is
# a readdir and a stat per entry, far less than a long prompt's prefill, but not for every request.
RELIST_AFTER_S = 0.25
# How long a request waits for that listing: a healthy NFS lists hundreds of entries in well under
# a second; past this the request goes on with what is known.
RELIST_TIMEOUT_S = 1.0


class PrefixStore:
    """Opened by supervisor/prefix/opening.py (``open_private``, ``open_shared``,
    ``open_prefix_store``) over a directory and its first listing; :meth:`close` when done."""

    def __init__(
        self,
        io: Directory,
        found: Listing,
        *,
        fingerprint: StateFingerprint,
        max_bytes: int,
        min_tokens: int,
        host_id: str | None = None,
    ) -> None:
        """``found``: what ``io`` held when it was opened.  ``host_id``: written into each entry
        (its origin)."""
        self.io = io
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.host_id = host_id
        self._held = Ledger()
        self._counts = Counts()
        self._write_lock = trio.Lock()
        self._background = Background()  # a put's hash and copy, at nice 19
        self._pending: set[str] = set()  # token keys of puts in progress, written or waiting their turn
        self._failing = False  # within a burst of failed writes: logged once
        self._listed_at = trio.current_time()  # trio clock of the last listing
        # Told of each entry stored, evicted, dropped or restored, as it happens: the live feed's.
        self.on_event: Callable[[dict[str, Any]], None] = lambda event: None
        self._apply(found)

    async def trim(self, found: Listing) -> None:
        """What ``found`` (the listing the store was built from) holds over ``max_bytes`` (a lowered
        setting) evicted: the opener's last step."""
        async with self._write_lock:
            await self._make_room(found, 0)

    def close(self) -> None:
        """Let go of the directory (a private one's lock: another onebitd may then open it)."""
        self.io.close()
        self._background.close()

    @property
    def directory(self) -> Path:
        return self.io.path

    @property
    def shared(self) -> bool:
        """Its directory is shared with other hosts: list it again every ``cache.shared_rescan_s``."""
        return self.io.shared

    @property
    def degraded(self) -> bool:
        """The shared directory is unreachable and the private one takes the puts."""
        return self.io.degraded

    # -- finding and using entries ---------------------------------------------------------------

    def lookup(self, tokens: Sequence[int]) -> Entry | None:
        """The longest entry whose tokens ``tokens`` starts with (the whole of it included), or None.

        Counts a hit or a miss.  Pure and in memory: no await, no file touched.
        """
        found = self.peek(tokens)
        if found is None:
            self._counts.misses += 1
        else:
            self._counts.hits += 1
        return found

    def peek(self, tokens: Sequence[int]) -> Entry | None:
        """:meth:`lookup` without counting it."""
        return self._held.longest(tokens)

    async def find(self, tokens: Sequence[int]) -> Entry | None:
        """:meth:`lookup`, for a request: a shared directory is listed again first when the best
        entry known leaves at least ``min_tokens`` of the prompt to prefill, the last listing is older
        than :data:`RELIST_AFTER_S` and no write holds the directory (bounded: :data:`RELIST_TIMEOUT_S`).
        Degraded, the rescans alone look for the shared directory's return: not every request."""
        if self.shared and not self.degraded and self._falls_short(tokens) and not self._write_lock.locked():
            with trio.move_on_after(RELIST_TIMEOUT_S):
                await self.refresh()
        return self.lookup(tokens)

    def _falls_short(self, tokens: Sequence[int]) -> bool:
        if len(tokens) < self.min_tokens or trio.current_time() - self._listed_at < RELIST_AFTER_S:
            return False
        best = self.peek(tokens)
        return len(tokens) - (best.n_tokens if best is not None else 0) >= self.min_tokens

    async def refresh(self) -> None:
        """List the directory again, for what other hosts stored, used or evicted (a private one's
        listing reads nothing); one that cannot be listed now is said once, and lookups go on from
        what is known."""
        async with self._write_lock:
            await self._relist()

    @asynccontextmanager
    async def exposed(self, entry: Entry, directory: Path) -> AsyncIterator[str]:
        """Pin ``entry`` and show it as a fresh file name in ``directory`` (llama-server's
        ``--slot-save-path``) for the block; the name is removed on the way out, whatever happens.

        Raises :class:`~supervisor.errors.PrefixStoreError` when the entry is gone (evicted or
        dropped since the lookup, here or by another host), its state file no longer holds what was
        saved (its content hash differs: the entry is dropped, said once), or the name cannot be
        made.  Counts as a use for the LRU order.
        """
        key = entry.key
        if key not in self._held.entries:
            raise PrefixStoreError(f"prefix store entry {key} is gone")
        now = time.time()
        if not await self.io.use(key, now):
            self._held.vanished(key)
            raise PrefixStoreError(f"prefix store entry {key} is gone (another host evicted it)")
        self._held.pin(key)
        try:
            verified = await self.io.verify(key, entry.blake2b)
            if verified is None:
                raise PrefixStoreError(f"prefix store entry {key} could not be read in time")
            if not verified:
                self.drop(entry, "its state file does not match its content hash", level=logging.WARNING)
                raise PrefixStoreError(f"prefix store entry {key} is damaged (its content hash differs)")
            name = f"prefix-{key[:16]}-{os.urandom(4).hex()}{prefix_files.STATE}"
            link = directory / name
            try:
                os.symlink(self.io.state_path(key), link)
            except OSError as exc:
                raise PrefixStoreError(f"cannot expose prefix store entry {key}: {exc.strerror or exc}") from exc
            try:
                self._held.used(key, now)
                yield name
            finally:
                with contextlib.suppress(OSError):
                    link.unlink()
        finally:
            if self._held.release(key):
                self.io.remove(key)

    def drop(self, entry: Entry, reason: str = "refused by the decoder", *, level: int = logging.INFO) -> None:
        """Forget ``entry`` (the decoder refused it, or its ``cache_n`` shows it was not used): no
        lookup returns it again; its files go now, or when the last :meth:`exposed` block ends.
        An entry already gone is ignored."""
        if entry.key not in self._held.entries:
            return
        log.log(level, "prefix store: dropping entry %s (%d tokens): %s", entry.key, entry.n_tokens, reason)
        self._counts.drops += 1
        self._event("dropped", entry, why=reason)
        if self._held.forget(entry.key):
            self.io.remove(entry.key)

    def record_restore(self, ms: float, entry: Entry | None = None) -> None:
        """The caller timed a restore of ``entry`` (``POST /slots/S?action=restore``)."""
        self._counts.restores += 1
        if entry is not None and self.from_other_host(entry):
            self._counts.restores_other += 1
        self._counts.restore_ms_total += ms
        self._counts.restore_ms_last = ms
        self._event("restored", entry, ms=round(ms, 1))

    def from_other_host(self, entry: Entry) -> bool:
        """Whether another onebitd (another server.host_id) stored ``entry``."""
        return entry.origin_host is not None and entry.origin_host != self.host_id

    def _event(self, what: str, entry: Entry | None, **more: Any) -> None:
        """An entry's event for the feed: its size and origin, never its tokens."""
        if entry is not None:
            more.update(tokens=entry.n_tokens, bytes=entry.disk_bytes, origin_host=entry.origin_host)
        self.on_event({"what": what, **more})

    # -- filling it ------------------------------------------------------------------------------

    def wants(self, tokens: Sequence[int]) -> bool:
        """Whether a state file for ``tokens`` is worth saving: they are at least ``min_tokens``
        long, not stored (by any host) or being stored, and fewer than :data:`MAX_PENDING_PUTS`
        puts are in progress.  Pure; lets a caller skip ``?action=save``."""
        if len(tokens) < self.min_tokens or len(self._pending) >= MAX_PENDING_PUTS:
            return False
        try:
            key = token_key(tokens)
        except (OverflowError, TypeError):
            return False
        return not self._held.holds(tokens) and key not in self._pending

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
        if len(tokens) < self.min_tokens:
            self._counts.skipped += 1
            return False
        try:
            key = token_key(tokens)
        except (OverflowError, TypeError):
            log.warning("prefix store: refusing a put whose tokens are not llama.cpp tokens")
            self._counts.skipped += 1
            return False
        if self._held.holds(tokens) or key in self._pending:
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
        """The put's turn at the disk (under the write lock): the directory listed again, room made
        (least recently used out, of any host in a shared directory, never a pinned one), then the
        entry written under a name of the directory's choosing.  True when stored."""
        created = time.time()
        try:
            state_bytes = os.stat(path).st_size  # in the state directory, a tmpfs: no need for a thread
            blake2b = await self._background.run(prefix_files.digest, path)  # both at nice 19 (background.py)
        except OSError as exc:
            self._failed(key, exc)
            return False
        fingerprint = self.fingerprint.as_json()
        sidecar = prefix_files.render_sidecar(tokens, fingerprint, state_bytes, created, self.host_id, blake2b=blake2b)
        need = state_bytes + len(sidecar)
        found = await self._relist()
        if found is None:
            self._counts.store_failures += 1
            return False
        if need > self.max_bytes or not await self._make_room(found, need):
            log.debug("prefix store: no room for %s (%d bytes)", key, need)
            self._counts.skipped += 1
            return False
        name = self.io.name(key)
        try:
            await self._background.run(self.io.write, name, path, sidecar, state_bytes)
        except OSError as exc:
            self._failed(key, exc)
            return False
        if self._failing:
            log.info("prefix store: storing works again")
            self._failing = False
        entry = Entry(name, tokens, state_bytes, need, created, created, self.host_id, blake2b)
        self._held.add(entry)
        self._counts.stores += 1
        self._event("stored", entry)
        return True

    def _failed(self, key: str, exc: OSError) -> None:
        self._counts.store_failures += 1
        if not self._failing:
            log.warning("prefix store: cannot store %s: %s (further failures not logged)", key, exc.strerror or exc)
            self._failing = True

    async def _make_room(self, found: Listing, need: int) -> bool:
        """Evict the least recently used unpinned entries of ``found``'s budget until ``need`` more
        bytes fit within ``max_bytes``: out of the index and the accounting first, then off the disk
        (in a worker thread).  False, and nothing evicted, when pins prevent it."""
        victims = choose_victims(found.listed, need + found.leftovers, self.max_bytes, set(self._held.pins))
        if victims is None:
            return False
        if not victims:
            return True
        known = self._held.take_out(victims, found.listed)
        removed = await trio.to_thread.run_sync(lambda: [name for name in victims if self.io.remove(name)])
        for name in removed:  # another host may have taken the others: gone either way
            entry = known[name]
            if entry is None:
                log.info("prefix store: evicting entry %s", name)
            else:
                log.info("prefix store: evicting entry %s (%d tokens)", name, entry.n_tokens)
            self._counts.evictions += 1
            self._event("evicted", entry)
        return True

    # -- what the directory holds ----------------------------------------------------------------

    async def _relist(self) -> Listing | None:
        """Under the write lock: the directory's listing taken in (None: the directory the next put
        goes to cannot be listed; what is known stays as it is)."""
        found = await self.io.list(self._held.known())
        if found is not None:
            self._listed_at = trio.current_time()
            self._apply(found)
        return found

    def _apply(self, found: Listing) -> None:
        self._held.apply(found)
        self._counts.evictions += found.aged
        self._counts.drops += found.cleaned

    # -- introspection, for onebitctl ------------------------------------------------------------

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(
            enabled=True,
            directory=str(self.directory),
            entries=len(self._held.entries),
            bytes=self._held.bytes,
            max_bytes=self.max_bytes,
            pinned=len(self._held.pins),
            host_id=self.host_id,
            shared=self.shared and not self.degraded,
            shared_problem=self.io.problem,
            **self._counts.figures(),
        )

    def list(self) -> list[Entry]:
        """Every entry, most recently used first."""
        return list(reversed(self._held.entries.values()))

    async def clear(self) -> int:
        """Remove every entry (pinned ones when released); returns how many were removed."""
        keys = list(self._held.entries)
        unpinned = [key for key in keys if self._held.forget(key)]
        with trio.CancelScope(shield=True):
            for key in unpinned:
                await trio.to_thread.run_sync(self.io.remove, key)
        log.info("prefix store: cleared %d entries", len(keys))
        return len(keys)
