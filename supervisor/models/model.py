"""One model the daemon serves, loaded and unloaded by the one task that owns its state.

    Model.run ─ the owner of ModelState; per load, a nursery:
        ├── Child(decoder).run      llama-server on <dir>/decoder.sock: spawn, health-gate, restart
        ├── Provider.run            each of its [[provider]]s: its Child, or none (exec)
        └── Completions.run         the prefix store's saves, off the requests' path

A load builds its parts afresh and whole (:class:`~supervisor.models.parts.Parts`) from its
:class:`~supervisor.models.layout.Layout`: the devices and ``kv_unified`` decided before the model's
first start (:meth:`Model.choose_layout`), ``swa_full`` from the file the load reads.  Its state is
:class:`ModelState` and ``TRANSITIONS``, owned by the one task that runs :meth:`Model.run`; the
scheduler (supervisor/models/registry.py) asks through :meth:`Model.want` and waits with
:meth:`Model.wait_state`.  :meth:`Model._one_load` is a load's whole sequence, start to unload.

Before an unload the slots whose prompts the prefix store would keep are saved into it
(supervisor/models/keep.py); the model's prefix store is the daemon's for its lifetime, not the load's.

Where its files go: ``<runtime_dir>/decoder.sock`` and ``<runtime_dir>/state`` with the single
``[model]`` table; ``<runtime_dir>/model-<name>/`` for each of several
(supervisor/config/modelspec.py).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from ..config import ModelConfig, modelspec
from ..config.live import Settings
from ..config.modelspec import ModelSpec
from ..errors import DecoderUnavailable
from ..llama.decoder import DecoderClient
from ..observe.status import ModelStatistics
from ..prefix.statistics import OFF, StoreStatistics
from ..prefix.store import PrefixStore
from ..providers.seat import Seats
from ..routes.completion import Completions
from ..supervise.child import Child, ChildState
from ..supervise.states import StateMachine
from . import keep, layout, memory
from .layout import Layout
from .memory import ModelFile, rss_mib
from .parts import SHARE_CONNECT_TIMEOUT_S, Parts, Proven, share_enabled

__all__ = ["SHARE_CONNECT_TIMEOUT_S", "TRANSITIONS", "Model", "ModelState", "Parts", "StoreOpener", "share_enabled"]

log = logging.getLogger("onebit.model")


class ModelState(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"  # its decoder spawned, not yet healthy
    LOADED = "loaded"  # its decoder ready: requests go to it
    FAILED = "failed"  # its decoder failed too often: requests get 503 until it is unloaded
    UNLOADING = "unloading"  # its slots being saved, its children stopped


M = ModelState
TRANSITIONS: dict[ModelState, frozenset[ModelState]] = {
    M.UNLOADED: frozenset({M.LOADING}),
    M.LOADING: frozenset({M.LOADED, M.FAILED, M.UNLOADING}),
    M.LOADED: frozenset({M.FAILED, M.UNLOADING, M.LOADING}),  # LOADING: its decoder restarting
    M.FAILED: frozenset({M.UNLOADING}),
    M.UNLOADING: frozenset({M.UNLOADED}),
}


# How the daemon opens a model's prefix store (it knows the decoder's version): open for the
# model's lifetime in the daemon, closed on the way out.
StoreOpener = Callable[["Model"], contextlib.AbstractAsyncContextManager[PrefixStore | None]]


class Model:
    def __init__(
        self,
        spec: ModelSpec,
        *,
        runtime_dir: Path,
        settings: Settings,
        check_fidelity: bool = True,
        seats: Seats | None = None,
    ) -> None:
        """``runtime_dir``: the daemon's; ``settings``: the daemon's config now (a reload swaps it)."""
        self.spec = spec
        self.name = spec.name
        self.dir = runtime_dir / spec.subdir if spec.subdir else runtime_dir
        self._settings = settings
        self.check_fidelity = check_fidelity
        self.seats = seats
        self.layout = Layout()  # its devices and kv_unified: choose_layout(), before any child starts
        self._lifecycle = StateMachine(f"model {self.name}", TRANSITIONS, ModelState.UNLOADED)
        self._wake = trio.Event()
        self._wanted = False
        self.users = 0
        self.loads = 0
        self.last_load_ms: float | None = None  # its decoder's spawn to healthy
        self.last_unload_ms: float | None = None  # its slots kept and its children stopped
        self.last_used: float | None = None  # trio clock: the scheduler's LRU order
        self.loaded_at: float | None = None  # trio clock: its last load's end (idle since, if unused since)
        self._last_used_wall: float | None = None
        self.store: PrefixStore | None = None  # opened by run(); None: no store (off, or it cannot work)
        # Called after every transition: the scheduler's (Models.kick) once it holds the model.
        self.on_change: Callable[[], None] = lambda: None
        # Told every transition of the model's and of its decoder's, as an event of the daemon's
        # feed (supervisor/observe/routestats.py's publish: onebitctl watch, the status page).
        self.on_event: Callable[[dict[str, Any]], None] = lambda event: None
        self.parts = self._parts()

    def _parts(self, proven: Proven | None = None, found: ModelFile | None = None) -> Parts:
        """A load's parts, from its layout; ``found``: the model's file as already read for it (else
        the load reads it, once: a file replaced since is the next load's)."""
        found = found or memory.read_model(self.spec)
        budget = self._settings().models.memory_budget_mib
        return Parts(
            self.spec,
            layout=attrs.evolve(self.layout, swa_full=layout.swa_full(self.spec, found, budget)),
            model_file=found,
            runtime_dir=self.dir,
            settings=self._settings,
            check_fidelity=self.check_fidelity,
            on_decoder=self._on_decoder,
            on_provider=self._on_child,
            seats=self.seats,
            model_idle=lambda: self.users == 0,
            proven=proven,
        )

    @property
    def estimate_mib(self) -> float:
        """Its memory from its GGUF header, as its load's parts read it, in their layout (models/memory.py)."""
        return memory.estimate_mib(self.spec, self.parts.model_file, swa_full=self.parts.swa_full)

    def fresh_parts(self) -> None:
        """After an unload: the next load's parts, with the restore probe's verdict carried over
        (the same build, flags and file: not probed again unless it was withdrawn)."""
        self.parts = self._parts(self.parts.proven)

    # -- what others read ----------------------------------------------------------------------------

    @property
    def state(self) -> ModelState:
        return self._lifecycle.state

    @property
    def table(self) -> ModelConfig:
        """This model's [[model]] table as the running config has it now (ttl_s, pin are live)."""
        return modelspec.table_now(self._settings(), self.spec)

    @property
    def decoder(self) -> Child:
        return self.parts.decoder

    @property
    def completions(self) -> Completions:
        return self.parts.completions

    @property
    def client(self) -> DecoderClient:
        return self.parts.client

    @property
    def swa_full(self) -> bool:
        """Its llama-servers keep the sliding-window layers' every cell (supervisor/models/layout.py)."""
        return self.parts.swa_full

    def children(self) -> list[Child]:
        return [self.parts.decoder, *self.parts.provider_children()]

    def memory_mib(self) -> float:
        """Measured while loaded (the decoder's and its providers' RSS), else the estimate."""
        if self.state is ModelState.LOADED:
            measured = [rss_mib(child.pid) for child in self.children()]
            known = [m for m in measured if m is not None]
            if known:
                return sum(known)
        return self.estimate_mib

    def statistics(self) -> ModelStatistics:
        table = self.table
        capability = self.parts.capability
        return ModelStatistics(
            name=self.name,
            aliases=self.spec.aliases,
            state=self.state.value,
            default=self.spec.default,
            pin=table.pin,
            ttl_s=table.ttl_s,
            users=self.users,
            loads=self.loads,
            last_load_ms=None if self.last_load_ms is None else round(self.last_load_ms, 1),
            last_unload_ms=None if self.last_unload_ms is None else round(self.last_unload_ms, 1),
            last_used=self._last_used_wall,
            memory_mib=round(self.memory_mib(), 1),
            estimate_mib=round(self.estimate_mib, 1),
            pid=self.parts.decoder.pid,
            state_since=self._lifecycle.since,
            slots=self.parts.slots.statistics(),
            providers=tuple(self.parts.providers.statistics()),
            store=self.store_statistics(),
            restores="withdrawn" if capability.withdrawn is not None else capability.restores.value,
            restores_why=capability.withdrawn or capability.why,
            slot_context=None if self.parts.slot_context is None else self.parts.slot_context.n_ctx,
            swa_full=self.parts.swa_full,
            share_refused=self.share_refused(),
        )

    def share_refused(self) -> str:
        """Why its running decoder refused the share route; empty where it has not or the route is off."""
        share = self.parts.hybrid.share if self.parts.hybrid is not None else None
        return (share.refusal(self.parts.decoder.generation) if share is not None else None) or ""

    def store_statistics(self) -> StoreStatistics:
        return self.store.statistics() if self.store is not None else OFF

    async def keep_slots(self, draining: Callable[[], bool]) -> int:
        """A drain's last step (no request in flight): the store's writes in progress finish, and
        each slot whose prompt the store would keep (and does not hold yet) is saved into it, so
        that the host its conversations move to restores them (a shared store) or this one does
        after its restart.  ``draining``: whether the daemon still drains (a resume stops it).  How
        many slots it saved."""
        stored = self.parts.completions.stored
        if self.state is not ModelState.LOADED or stored is None or self.decoder.state is not ChildState.READY:
            return 0
        await stored.wait_writes()
        return await keep.keep_slots(self.parts.slots, stored, self.name, draining)

    async def wait_state(self, *states: ModelState) -> ModelState:
        return await self._lifecycle.wait_for(*states)

    async def wait_changed(self) -> None:
        await self._lifecycle.wait_changed()

    def check_serving(self) -> None:
        """Raise DecoderUnavailable (503) unless requests may go to it now."""
        if self.state is ModelState.LOADED:
            return
        if self.state is ModelState.FAILED:
            words = f"model {self.name} has failed ({self.decoder.statistics().last_exit}); see onebitd's log"
        else:
            words = f"model {self.name} is {self.state.value}; try again shortly"
        raise DecoderUnavailable(words, public=words)

    # -- what the scheduler asks -----------------------------------------------------------------

    def want(self, loaded: bool) -> None:
        """Ask the owner task to load (True) or unload (False) the model; it acts when it can."""
        if self._wanted != loaded:
            self._wanted = loaded
            self._wake.set()

    @property
    def wanted(self) -> bool:
        return self._wanted

    def hold(self) -> None:
        """A request is using the model: it is not unloaded under it."""
        self.users += 1
        self.touch()

    def release(self) -> None:
        self.users -= 1
        self.touch()
        if not self.users and not self._wanted:
            self._wake.set()  # its unload waits for the last request

    def idle_since(self, now: float) -> float:
        """Since when it has been idle, for ``ttl_s`` and the LRU order: its last use or the end of
        its last load, whichever came later (a preloaded model, or one ``onebitctl load`` brought
        back, is not idle since before it was loaded); ``now`` while its first load is under way."""
        times = [t for t in (self.last_used, self.loaded_at) if t is not None]
        return max(times) if times else now

    def touch(self) -> None:
        self.last_used = trio.current_time()
        self._last_used_wall = time.time()

    # -- the owner task ---------------------------------------------------------------------------

    def _set(self, new: ModelState, why: str = "") -> None:
        old = self._lifecycle.move(new)
        log.info("model %s: %s -> %s%s", self.name, old.value, new.value, f" ({why})" if why else "")
        self.on_change()
        self.on_event({"event": "model", "model": self.name, "from": old.value, "to": new.value, "why": why})

    def _on_decoder(self, child: Child, old: ChildState, new: ChildState, why: str) -> None:
        self._wake.set()
        self._on_child(child, old, new, why)

    def _on_child(self, child: Child, old: ChildState, new: ChildState, why: str) -> None:
        """A move of its decoder's or a provider's child, for the live feed."""
        event = {"event": "child", "model": self.name, "child": child.name, "from": old.value, "to": new.value}
        self.on_event({**event, "why": why})

    async def _woken(self) -> None:
        await self._wake.wait()
        self._wake = trio.Event()

    async def choose_layout(self) -> None:
        """Before its first start: the model's layout (supervisor/models/layout.py), asked of its first
        load's providers; that load's parts are then built whole from it (those that asked go unused)."""
        self.layout = await layout.choose(self.parts.llama_providers())
        if self.layout != Layout():
            first, self.parts = self.parts, self._parts(found=self.parts.model_file)
            await first.client.aclose()

    def prepare_dir(self) -> None:
        """Whatever a crashed daemon left in the model's directory belongs to no live request."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        state = self.dir / "state"
        if state.is_dir():
            for leftover in state.iterdir():
                # Files, and the links a prefix-store restore exposes (dangling once the store moved on).
                if leftover.is_symlink() or leftover.is_file():
                    leftover.unlink(missing_ok=True)
        for leftover in self.dir.glob("share-*.sock"):
            leftover.unlink(missing_ok=True)

    async def run(
        self, open_store: StoreOpener | None = None, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Own the model's state until cancelled: load when wanted, unload when not.  ``started``
        once its layout is chosen and its prefix store open (``open_store``: the daemon's, for this
        model); it is then unloaded, and the scheduler's ``want(True)`` loads it."""
        await self.choose_layout()
        self.prepare_dir()
        async with contextlib.AsyncExitStack() as stack:
            if open_store is not None:
                self.store = await stack.enter_async_context(open_store(self))
                if self.store is not None:
                    self.store.on_event = lambda event: self.on_event({"event": "store", "model": self.name, **event})
            task_status.started()
            try:
                while True:
                    while not self._wanted:
                        await self._woken()
                    await self._one_load()
            finally:
                with trio.CancelScope(shield=True):
                    await self.parts.client.aclose()

    async def _one_load(self) -> None:
        parts = self.parts
        began = trio.current_time()
        self._set(ModelState.LOADING, "asked for")
        clean = False
        probed = False
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(parts.decoder.run)
                for provider in parts.providers.all:
                    await nursery.start(provider.run)
                stored = parts.stored_prefixes(self.store, self.spec.config.cache.shared_rescan_s)
                await nursery.start(parts.completions.run, stored)
                # Unwanted, it goes on serving the requests that hold it: none is unloaded under it.
                while self._wanted or self.users:
                    decoder = parts.decoder.state
                    probed = probed and decoder is ChildState.READY
                    if decoder is ChildState.READY and self.state is ModelState.LOADING and not probed:
                        # Its slot context and what its restores can do, before it takes requests.
                        await parts.after_start(self.store is not None)
                        probed = True
                        continue
                    if decoder is ChildState.READY and self.state is ModelState.LOADING:
                        self.loads += 1
                        self.last_load_ms = (trio.current_time() - began) * 1000
                        self.loaded_at = trio.current_time()
                        self._set(ModelState.LOADED, f"in {self.last_load_ms:.0f} ms")
                    elif decoder is ChildState.FAILED and self.state is not ModelState.FAILED:
                        self._set(ModelState.FAILED, parts.decoder.statistics().last_exit or "its decoder failed")
                    elif decoder in (ChildState.BACKOFF, ChildState.STARTING) and self.state is ModelState.LOADED:
                        began = trio.current_time()
                        self._set(ModelState.LOADING, "its decoder is restarting")
                    await self._woken()
                self._set(ModelState.UNLOADING, "no longer wanted")
                unloading = trio.current_time()
                if parts.decoder.state is ChildState.READY and stored is not None:
                    await keep.keep_slots(parts.slots, stored, self.name)
                nursery.cancel_scope.cancel()
            clean = True
        finally:
            with trio.CancelScope(shield=True):
                if parts.hybrid is not None:
                    # Every provider is stopped: what one wrote for a job we gave up on goes now.
                    parts.hybrid.file.sweep()
                await parts.client.aclose()
                for path in parts.sockets():
                    with contextlib.suppress(OSError):
                        path.unlink(missing_ok=True)
            if clean:
                self.last_unload_ms = (trio.current_time() - unloading) * 1000
                self._set(ModelState.UNLOADED, f"its children stopped in {self.last_unload_ms:.0f} ms")
                self.fresh_parts()
