"""The prefix store a config describes (``open_prefix_store``): none where it is off or cannot work,
else a store over its directory: shared with other hosts when ``cache.shared_dir`` says so (with the
private one beside it, for while the shared one is unreachable), else private.  Its fingerprint is
the decoder's that writes into it, made from the model file and llama-server's version.

This is the one place that decides whether there is a store: each way it cannot work is one log
line here, and the caller gets None.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from ..config import Config, locate
from ..llama.llama_server import StateFingerprint
from .directory import Directory, Listing
from .fallback import FallbackDirectory
from .files import Disk
from .private import PrivateDirectory
from .shareddir import SharedDirectory
from .store import PrefixStore

log = logging.getLogger("onebit.prefix")


def off(reason: str, *, level: int = logging.WARNING) -> None:
    """Say why there is no prefix store (one line); the caller then holds None."""
    log.log(level, "prefix store: off: %s", reason)


async def open_private(
    directory: Path,
    *,
    fingerprint: StateFingerprint,
    max_bytes: int,
    min_tokens: int,
    disk: Disk | None = None,
    host_id: str | None = None,
    shared_problem: str | None = None,
) -> PrefixStore | None:
    """The store in ``directory`` (made if need be, locked), its entries checked against
    ``fingerprint``; entries over ``max_bytes`` (a lowered setting) are evicted.  None, said in one
    line, when the directory cannot be made, written, locked or read.  ``shared_problem``: why the
    shared directory configured is not the one in use."""
    opened = await _private(directory, fingerprint, max_bytes, disk or Disk(), shared_problem)
    if opened is None:
        return None
    io, found = opened
    return await _store(io, [found], fingerprint, max_bytes, min_tokens, host_id)


async def open_shared(
    directory: Path,
    *,
    host_id: str,
    fingerprint: StateFingerprint,
    max_bytes: int,
    min_tokens: int,
    max_age_s: float,
    disk: Disk | None = None,
    private: Path | None = None,
    clock: Callable[[], float] = time.time,
) -> PrefixStore:
    """The store in ``directory``, shared with other hosts: not locked; ``host_id`` names this
    host's files and entries; ``max_bytes`` bounds the directory, every host's entries together;
    an entry unused for ``max_age_s`` is evicted.  ``private``: the host's private directory,
    opened (and locked) beside it, where puts go while the shared one is unreachable (what an
    earlier such time left there is found).  ``clock``: this host's (a test's seam: ages are
    measured on the directory's).  Raises OSError when the shared directory cannot be made, written
    or listed."""
    disk = disk or Disk()
    shared, found = await SharedDirectory.open(
        directory, host_id=host_id, fingerprint=fingerprint.as_json(), max_age_s=max_age_s, disk=disk, clock=clock
    )
    others = sum(1 for entry in found.entries.values() if entry.origin_host != host_id)
    log.info(
        "prefix store: shared: %s as host %s: %d entries (%d of other hosts), %d bytes of %d for all hosts",
        shared.path,
        host_id,
        len(found.entries),
        others,
        found.bytes,
        max_bytes,
    )
    opened = await _private(private, fingerprint, max_bytes, disk) if private is not None else None
    if opened is None:
        return await _store(shared, [found], fingerprint, max_bytes, min_tokens, host_id)
    beside, kept = opened
    both = Listing(
        {**found.entries, **kept.entries},
        found.listed,
        found.cleaned + kept.cleaned,
        found.aged,
        leftovers=found.leftovers,
    )
    return await _store(FallbackDirectory(shared, beside), [kept, both], fingerprint, max_bytes, min_tokens, host_id)


async def _private(
    path: Path, fingerprint: StateFingerprint, max_bytes: int, disk: Disk, problem: str | None = None
) -> tuple[PrivateDirectory, Listing] | None:
    """A private directory opened (one line: what it holds, or why it cannot be used)."""
    try:
        io, found = await PrivateDirectory.open(path, fingerprint.as_json(), disk=disk, problem=problem)
    except OSError as exc:
        off(f"{path}: {exc.strerror or exc}")
        return None
    log.info("prefix store: %s: %d entries, %d bytes of %d", io.path, len(found.entries), found.bytes, max_bytes)
    return io, found


async def _store(
    io: Directory,
    budgets: list[Listing],
    fingerprint: StateFingerprint,
    max_bytes: int,
    min_tokens: int,
    host_id: str | None,
) -> PrefixStore:
    """The store over ``io``, built from its last listing (of ``budgets``: what each of its
    directories held), each directory then brought within ``max_bytes``."""
    store = PrefixStore(
        io, budgets[-1], fingerprint=fingerprint, max_bytes=max_bytes, min_tokens=min_tokens, host_id=host_id
    )
    for found in budgets:
        await store.trim(found)
    return store


@asynccontextmanager
async def open_prefix_store(
    config: Config,
    server_version: str,
    *,
    kv_unified: bool = False,
    engines: Sequence[str] = (),
    swa_full: bool = False,
) -> AsyncIterator[PrefixStore | None]:
    """The store ``[cache]`` describes, for the decoder ``config`` starts (``kv_unified``, ``engines``, ``swa_full``:
    what the daemon resolved, for the fingerprint); closed on the way out.

    Never raises for the file system or the model file: there is then no store (None, one log line).
    """
    cache = config.cache
    store: PrefixStore | None = None
    if not cache.enabled:
        off("cache.enabled is false", level=logging.INFO)
    else:
        try:
            fingerprint = await trio.to_thread.run_sync(
                functools.partial(
                    StateFingerprint.of,
                    config,
                    server_version,
                    kv_unified=kv_unified,
                    engines=engines,
                    swa_full=swa_full,
                )
            )
        except OSError as exc:
            off(f"cannot identify the model file: {exc.strerror or exc}")
        else:
            store = await _open(config, fingerprint)
    try:
        yield store
    finally:
        if store is not None:
            store.close()


async def _open(config: Config, fingerprint: StateFingerprint) -> PrefixStore | None:
    """The shared store when one is configured and usable, else the private one (saying why)."""
    cache = config.cache
    private = locate.prefix_store_dir(cache.dir, port=config.server.port)
    host_id = locate.host_id(config.server.host_id)
    shared = locate.shared_store_dir(cache.shared_dir)
    problem = None
    if shared is not None:
        try:
            return await open_shared(
                shared,
                host_id=host_id,
                fingerprint=fingerprint,
                max_bytes=cache.max_bytes,
                min_tokens=cache.min_tokens,
                max_age_s=cache.shared_max_age_s,
                private=private,
            )
        except OSError as exc:
            problem = f"{shared}: {exc.strerror or exc}"
            log.warning(
                "prefix store: cannot use the shared directory %s: %s; this host stores privately in %s",
                shared,
                exc.strerror or exc,
                private,
            )
    return await open_private(
        private,
        fingerprint=fingerprint,
        max_bytes=cache.max_bytes,
        min_tokens=cache.min_tokens,
        host_id=host_id,
        shared_problem=problem,
    )
