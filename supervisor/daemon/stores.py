"""Each model's prefix store as the daemon opens it: for the decoder's version, asked once
(``llama-server --version``), and the model's layout and engines, which its fingerprint names."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from ..config import Config, locate
from ..errors import ChildError
from ..llama.llama_server import server_version
from ..models.model import Model
from ..prefix.opening import off, open_prefix_store
from ..prefix.store import PrefixStore

log = logging.getLogger("onebit.daemon")


class Stores:
    def __init__(self) -> None:
        self._version: str | None = None
        self._version_problem = "not asked yet"

    async def ask_version(self, config: Config) -> None:
        """``llama-server --version``, once, for every model's prefix store fingerprint."""
        if not config.cache.enabled:
            return
        binary = locate.llama_server(config.decoder.binary)
        try:
            if binary is None:
                raise ChildError("no llama-server binary")
            self._version = await server_version(binary)
            # Its own lines are below log.children: the version is said once, as onebitd's.
            log.info("llama-server %s: %s", binary, self._version)
        except ChildError as exc:
            self._version_problem = f"cannot tell the decoder's version: {exc}"

    @asynccontextmanager
    async def open(self, model: Model) -> AsyncIterator[PrefixStore | None]:
        """The prefix store ``[cache]`` describes for ``model``; None (one log line) when it is off or cannot work."""
        config = model.spec.config
        if not config.cache.enabled:
            off("cache.enabled is false", level=logging.INFO)
            yield None
            return
        if self._version is None:
            off(self._version_problem)
            yield None
            return
        engines = [p.describe for p in model.parts.llama_providers()]
        async with open_prefix_store(
            config, self._version, kv_unified=model.layout.kv_unified, engines=engines, swa_full=model.swa_full
        ) as store:
            yield store
