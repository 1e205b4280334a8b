"""Which model serves a request, as the front sees it: :class:`Router` (the daemon's registry,
supervisor/models/registry.py's Models) and :class:`One`, the router of a front with one model and
nothing else (a test's, a tool's)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol

import attrs

from ..llama.decoder import DecoderClient
from ..routeline import RouteLine
from ..routes.completion import Completions, Decoder
from ..supervise.child import ChildState


class Served(Protocol):
    """What a request needs of the model that serves it (supervisor/models/model.py's Model)."""

    @property
    def completions(self) -> Completions: ...

    @property
    def client(self) -> DecoderClient: ...

    @property
    def decoder(self) -> Decoder: ...


class Router(Protocol):
    """Which model serves a request (supervisor/models/registry.py's Models)."""

    @property
    def several(self) -> bool: ...

    @property
    def default(self) -> Served:
        """The model that owns every conversation's stream session, and whose decoder's metrics a
        scrape appends."""
        ...

    def use(
        self, asked: Any, line: RouteLine | None = None, *, any_loaded: bool = False
    ) -> AbstractAsyncContextManager[Served]:
        """The model the request's ``model`` names, held for the block; ClientError 404 for none.
        ``any_loaded``: a request that names none may go to any loaded model (a relayed GET)."""
        ...

    def health_state(self) -> ChildState: ...

    def unrestorable(self) -> dict[str, str]: ...

    def listing(self) -> dict[str, Any]: ...


@attrs.frozen
class One:
    """The router of a front with one model and nothing else."""

    completions: Completions
    client: DecoderClient
    decoder: Decoder
    several = False

    @property
    def default(self) -> Served:
        return self

    @asynccontextmanager
    async def use(
        self, asked: Any, line: RouteLine | None = None, *, any_loaded: bool = False
    ) -> AsyncIterator[Served]:
        yield self

    def health_state(self) -> ChildState:
        return self.decoder.state

    def unrestorable(self) -> dict[str, str]:
        return {}

    def listing(self) -> dict[str, Any]:
        return {}
