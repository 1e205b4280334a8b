"""The prefix store a config describes: its directory (shared with other hosts when
``cache.shared_dir`` says so, else private), and the fingerprint of the decoder that writes into it,
made from the model file and llama-server's version (``open_prefix_store``)."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from ..config import Config, locate
from ..llama.llama_server import StateFingerprint
from .sharedstore import SharedPrefixStore
from .store import PrefixStore

log = logging.getLogger("onebit.prefix")


@asynccontextmanager
async def open_prefix_store(
    config: Config,
    server_version: str,
    *,
    kv_unified: bool = False,
    engines: Sequence[str] = (),
    swa_full: bool = False,
) -> AsyncIterator[PrefixStore]:
    """The store ``[cache]`` describes, for the decoder ``config`` starts (``kv_unified``, ``engines``, ``swa_full``:
    what the daemon resolved, for the fingerprint); closed on the way out.

    Never raises for the file system or the model file: the store is then disabled (one log line).
    """
    cache = config.cache
    store: PrefixStore
    if not cache.enabled:
        store = PrefixStore.disabled("cache.enabled is false", level=logging.INFO)
    else:
        directory = locate.prefix_store_dir(cache.dir, port=config.server.port)
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
            store = PrefixStore.disabled(f"cannot identify the model file: {exc.strerror or exc}")
        else:
            store = await _open(config, directory, fingerprint)
    try:
        yield store
    finally:
        store.close()


async def _open(config: Config, private: Path, fingerprint: StateFingerprint) -> PrefixStore:
    """The shared store when one is configured and usable, else the private one (saying why)."""
    cache = config.cache
    host_id = locate.host_id(config.server.host_id)
    shared = locate.shared_store_dir(cache.shared_dir)
    problem = None
    if shared is not None:
        try:
            store = await SharedPrefixStore.open_shared(
                shared,
                host_id=host_id,
                fingerprint=fingerprint,
                max_bytes=cache.max_bytes,
                min_tokens=cache.min_tokens,
                max_age_s=cache.shared_max_age_s,
            )
        except OSError as exc:
            problem = f"{shared}: {exc.strerror or exc}"
            log.warning(
                "prefix store: cannot use the shared directory %s: %s; this host stores privately in %s",
                shared,
                exc.strerror or exc,
                private,
            )
        else:
            # Where puts go while the shared directory is lost (and what they left there, found).
            store.fallback = await PrefixStore.open(
                private,
                fingerprint=fingerprint,
                max_bytes=cache.max_bytes,
                min_tokens=cache.min_tokens,
                host_id=host_id,
            )
            fallback = store.fallback
            fallback.on_event = lambda event: store.on_event(event)  # the shared store's listener, whenever set
            return store
    return await PrefixStore.open(
        private,
        fingerprint=fingerprint,
        max_bytes=cache.max_bytes,
        min_tokens=cache.min_tokens,
        host_id=host_id,
        shared_problem=problem,
    )
