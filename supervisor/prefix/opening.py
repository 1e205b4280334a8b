"""The prefix store a config describes: its directory, and the fingerprint of the decoder that
writes into it, made from the model file and llama-server's version (``open_prefix_store``)."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import trio

from ..config import Config, locate
from ..llama.llama_server import StateFingerprint
from .store import PrefixStore


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
            store = await PrefixStore.open(
                directory, fingerprint=fingerprint, max_bytes=cache.max_bytes, min_tokens=cache.min_tokens
            )
    try:
        yield store
    finally:
        store.close()
