"""Which model serves a request, as the front sees it: :class:`Router` (the daemon's registry,
supervisor/models/registry.py's Models) and :class:`One`, the router of a front with one model and
nothing else (a test's, a tool's)."""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from ..llama.decoder import DecoderClient
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


class Hold(Protocol):
    """A request's hold on its model (supervisor/models/registry.py's Held): the model for an
    ``async with`` block, and, even when it could not be had, which one and how long its load took."""

    @property
    def model(self) -> str | None: ...

    @property
    def load_ms(self) -> float | None: ...

    async def __aenter__(self) -> Served: ...

    async def __aexit__(self, *exc_info: object) -> None: ...


class Router(Protocol):
    """Which model serves a request (supervisor/models/registry.py's Models)."""

    @property
    def several(self) -> bool: ...

    @property
    def default(self) -> Served:
        """The model that owns every conversation's stream session, and whose decoder's metrics a
        scrape appends."""
        ...

    def use(self, asked: Any, *, any_loaded: bool = False) -> Hold:
        """The model the request's ``model`` names, held for the block; ClientError 404 for none.
        ``any_loaded``: a request that names none may go to any loaded model (a relayed GET)."""
        ...

    def health_state(self) -> ChildState: ...

    def unrestorable(self) -> dict[str, str]: ...

    def share_refused(self) -> dict[str, str]: ...

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

    def use(self, asked: Any, *, any_loaded: bool = False) -> Hold:
        return _HoldOne(self)

    def health_state(self) -> ChildState:
        return self.decoder.state

    def unrestorable(self) -> dict[str, str]:
        return {}

    def share_refused(self) -> dict[str, str]:
        return {}

    def listing(self) -> dict[str, Any]:
        return {}


@attrs.frozen
class _HoldOne:
    """:class:`One`'s hold: its one model, never loaded for a request, named on no route line."""

    served: Served
    model: str | None = None
    load_ms: float | None = None

    async def __aenter__(self) -> Served:
        return self.served

    async def __aexit__(self, *exc_info: object) -> None:
        return None
