"""The models a daemon serves: which one a request names, and which are loaded.

A request goes by its body's ``model`` (a name or an alias; none: ``models.default``).  With
several models (``[[model]]`` tables) an unknown one is a 404 naming those there are, and a
request for a model that is not loaded waits for it (bounded by ``server.queue_limit`` waiters and
``models.load_timeout_s``: then 503 with Retry-After) while the scheduler loads it.  With the single
``[model]`` table every request goes to its one model whatever it names, as llama-server does.

The scheduler's decisions are supervisor/models/schedule.py's, pure; :meth:`Models.run` is the one
task that decides, and requests and admin verbs wake it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import trio

from ..config import Config
from ..errors import ClientError, DecoderUnavailable, Overloaded
from ..observe.status import ModelsStatistics
from ..supervise.child import ChildState
from .model import Model, ModelState, StoreOpener
from .schedule import STARVE_S, Candidate, expired, in_the_way, plan, starving

log = logging.getLogger("onebit.models")

# The scheduler looks again at least this often: idle models' ttl_s, measured memory.
TICK_S = 1.0


class Models:
    """The registry of models and the scheduler of their loads."""

    def __init__(self, models: Sequence[Model], *, live: Callable[[], Config], several: bool) -> None:
        """``several``: [[model]] tables (requests go by ``model``, and wait for a load); else one model."""
        self.all: list[Model] = list(models)
        self._live = live
        self.several = several
        self._names: dict[str, Model] = {}
        self._default: Model | None = None
        self._index()
        self._wake = trio.Event()
        # Each model's waiters: when each began waiting (trio clock), in arrival order.
        self._waiting: dict[str, list[float]] = {}
        self.swaps = 0
        self._nursery: trio.Nursery | None = None
        self._open_store: StoreOpener | None = None
        self._scopes: dict[str, trio.CancelScope] = {}
        # Every preloaded model's first load is over (loaded or failed): /health, READY=1.
        self.settled = trio.Event()

    def _index(self) -> None:
        self._names = {name: model for model in self.all for name in model.spec.names}
        self._default = next((m for m in self.all if m.spec.default), self.all[0]) if self.all else None
        for model in self.all:
            model.on_change = self.kick

    @property
    def default(self) -> Model:
        """The model a request that names none goes to (``models.default``; else the first)."""
        assert self._default is not None
        return self._default

    def get(self, name: str) -> Model | None:
        return self._names.get(name)

    def names(self) -> list[str]:
        return [m.name for m in self.all]

    def find(self, asked: Any) -> Model:
        """The model a request's ``model`` field names; ClientError 404 for an unknown one."""
        if not self.several or asked is None or asked == "":
            return self.default
        if not isinstance(asked, str):
            raise ClientError(400, "bad_model", "model must be a string naming a model")
        model = self._names.get(asked)
        if model is None:
            raise ClientError(
                404, "model_not_found", f"no model named {asked!r}; models here: {', '.join(self.names())}"
            )
        return model

    # -- a request's hold on its model -----------------------------------------------------------

    def use(self, asked: Any, *, any_loaded: bool = False) -> Held:
        """The model ``asked`` names, loaded and held for an ``async with`` block (it is not unloaded
        under it); the hold says which model it was and how long the request waited for its load
        (``model``, ``load_ms``), even when it could not be had.  ``any_loaded``: with
        several models, a request that names none goes to the default one if it is loaded, else to
        the most recently used loaded one, and loads the default one only when none is."""
        return Held(self, asked, any_loaded)

    async def _take(self, asked: Any, held: Held, any_loaded: bool) -> Model:
        """:class:`Held`'s entry: the model, once it may be used, held."""
        if not self.several:
            model = self.default
            held.model = model.name
            # With one model, a request goes to it as it is (a decoder starting or restarting is a
            # 503, as ever), unless it was unloaded (ttl_s, onebitctl unload): then it is loaded
            # again, as one of several would be.
            if not model.wanted:
                await self._wait_for(model, held)
            model.hold()
            return model
        model = self.find(asked)
        if any_loaded and not self._admissible(model):
            loaded = [m for m in self.all if self._admissible(m)]
            if loaded:
                model = max(loaded, key=lambda m: m.last_used or 0.0)
        held.model = model.name
        if not self._admissible(model):
            await self._wait_for(model, held)
        model.hold()
        return model

    def _let_go(self, model: Model) -> None:
        """:class:`Held`'s exit."""
        model.release()
        if self._waiting:
            self.kick()  # a swap may wait for this model to be idle (ttl_s is looked at every TICK_S)

    def _admissible(self, model: Model) -> bool:
        return model.state is ModelState.LOADED and model.wanted and not self._blocked(model)

    async def _wait_for(self, model: Model, held: Held) -> None:
        if model.state is ModelState.FAILED:
            model.check_serving()
        waiting = sum(len(w) for w in self._waiting.values())
        if waiting >= self._live().server.queue_limit:
            raise Overloaded(f"{waiting} requests are waiting for models to load, and the queue is full")
        began = trio.current_time()
        queue = self._waiting.setdefault(model.name, [])
        queue.append(began)
        self.kick()
        timeout = self._live().models.load_timeout_s
        try:
            with trio.move_on_after(timeout):
                while not self._admissible(model):
                    if model.state is ModelState.FAILED:
                        model.check_serving()
                    await self._changed()
                return
            words = f"model {model.name} was not loaded within models.load_timeout_s ({timeout:g}s)"
            raise DecoderUnavailable(words, public=words)
        finally:
            queue.remove(began)
            if not queue:
                del self._waiting[model.name]
            held.load_ms = (trio.current_time() - began) * 1000
            self.kick()

    async def _changed(self) -> None:
        """Until a model's state changed (each one kicks), or a request began or ended."""
        await self._wake.wait()

    def kick(self) -> None:
        """Something changed that the scheduler (and the waiters) should look at."""
        self._wake.set()
        self._wake = trio.Event()

    # -- the scheduler -----------------------------------------------------------------------------

    def candidates(self, now: float, held: frozenset[str] = frozenset()) -> list[Candidate]:
        """Every model now.  A request waiting for a model counts as one of its users (a model loaded
        for its waiters is not unloaded before they take it), unless the model is on its way out or
        ``held`` for a starving one: its waiters wait for the other to be served."""
        return [
            Candidate(
                name=m.name,
                resident=m.state is not ModelState.UNLOADED or m.wanted,
                users=m.users + (len(self._waiting.get(m.name, ())) if m.wanted and m.name not in held else 0),
                pin=m.table.pin,
                last_used=m.idle_since(now),
                memory_mib=m.memory_mib(),
                ttl_s=m.table.ttl_s,
            )
            for m in self.all
        ]

    def _starving(self, now: float) -> list[Model]:
        """The waiting models past STARVE_S, oldest first."""
        found = [
            (queue[0], self._names[name])
            for name, queue in self._waiting.items()
            if name in self._names and starving(now - queue[0], STARVE_S)
        ]
        return [model for _since, model in sorted(found, key=lambda pair: pair[0])]

    def _held(self, now: float) -> frozenset[str]:
        """The models that take no new requests: those in the way of a starving model."""
        hungry = self._starving(now)
        if not hungry:
            return frozenset()
        bare = self.candidates(now, held=frozenset(self._names))  # their users, without waiters
        held: set[str] = set()
        for model in hungry:
            want = next(c for c in bare if c.name == model.name)
            since = self._waiting[model.name][0]
            # A model whose own waiters came first is not held for a younger one's sake.
            held.update(
                name
                for name in in_the_way(want, bare, **self.config_limits())
                if not (self._waiting.get(name) and self._waiting[name][0] < since)
            )
        return frozenset(held - {model.name for model in hungry})

    def _blocked(self, model: Model) -> bool:
        """New requests for ``model`` wait: it is going, or a starving model waits for its unload."""
        return not model.wanted or model.name in self._held(trio.current_time())

    def config_limits(self) -> dict[str, Any]:
        settings = self._live().models
        return {"max_loaded": settings.max_loaded, "budget_mib": float(settings.memory_budget_mib)}

    def decide(self) -> None:
        """One round of decisions: idle unloads, then loads for the waiting models (oldest first),
        unloading what is in their way once it is idle.  A model an older waiter is loading, or
        unloading to make room, is claimed: a younger waiter neither evicts nor re-loads it."""
        now = trio.current_time()
        # Every request's end wakes this: what costs (a model's memory reads /proc) is done only when
        # there is something to decide.
        if any(m.table.ttl_s > 0 for m in self.all):
            for name in expired(self.candidates(now), now):
                model = self._names[name]
                if model.wanted:
                    log.info("model %s: idle for its ttl_s (%gs): unloading", name, model.table.ttl_s)
                    model.want(False)
        if not self._waiting:
            return
        held = self._held(now)
        waiting = [name for name, _queue in sorted(self._waiting.items(), key=lambda item: item[1][0])]
        wanted = frozenset(m.name for m in self.all if m.wanted)
        decided = plan(waiting, self.candidates(now, held), wanted, **self.config_limits())
        for name in decided.unload:
            log.info("model %s: unloading to make room for %s", name, ", ".join(waiting))
            self.swaps += 1
            self._names[name].want(False)
        for name in decided.load:
            self._names[name].want(True)

    async def run(
        self, open_store: StoreOpener | None = None, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run every model (each ``started`` with its prefix store open), preload, then decide
        whenever something changed (and every TICK_S, for ttl_s)."""
        async with trio.open_nursery() as nursery:
            self._nursery, self._open_store = nursery, open_store
            for model in self.all:
                await nursery.start(self._run_model, model)
            for model in self.all:
                if model.spec.preload:
                    model.want(True)
            nursery.start_soon(self._settle)
            task_status.started()
            while True:
                self.decide()
                with trio.move_on_after(TICK_S):
                    await self._changed()

    async def _run_model(self, model: Model, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            self._scopes[model.name] = scope
            await model.run(self._open_store, task_status=task_status)

    async def _settle(self) -> None:
        for model in self.all:
            if model.spec.preload:
                await model.wait_state(ModelState.LOADED, ModelState.FAILED)
        self.settled.set()

    # -- a reload ---------------------------------------------------------------------------------

    def add(self, model: Model) -> None:
        """A model a reload added: run (and preload) it; the others are not touched."""
        assert self._nursery is not None
        self.all.append(model)
        self._index()
        self._nursery.start_soon(self._run_model, model)
        if model.spec.preload:
            model.want(True)
        self.kick()

    def remove(self, name: str) -> None:
        """A model a reload removed: no new request goes to it; it is unloaded once those that hold
        it are done, then its task ends."""
        model = self.named(name)
        self.all.remove(model)
        self._index()
        model.want(False)
        assert self._nursery is not None
        self._nursery.start_soon(self._retire, model)
        self.kick()

    async def _retire(self, model: Model) -> None:
        await model.wait_state(ModelState.UNLOADED)
        self._scopes.pop(model.name).cancel()

    # -- what the admin verbs ask ------------------------------------------------------------------

    async def load(self, name: str) -> Model:
        """Load ``name`` now (unloading what is in its way, once idle) and wait until it is loaded
        or failed; bounded by models.load_timeout_s."""
        model = self.named(name)
        if self.several:
            async with self.use(model.name):
                return model
        model.want(True)
        with trio.move_on_after(self._live().models.load_timeout_s):
            await model.wait_state(ModelState.LOADED, ModelState.FAILED)
        return model

    def named(self, name: str) -> Model:
        """The model of that name or alias; ClientError 404 naming the models there are."""
        model = self._names.get(name)
        if model is None:
            raise ClientError(
                404, "model_not_found", f"no model named {name!r}; models here: {', '.join(self.names())}"
            )
        return model

    async def unload(self, name: str) -> Model:
        """Unload ``name`` once no request holds it; wait until it is unloaded."""
        model = self.named(name)
        model.want(False)
        self.kick()
        await model.wait_state(ModelState.UNLOADED)
        return model

    def all_failed(self) -> bool:
        """Every model has failed for good (its decoder gave up restarting: decoder.restart), so none
        serves until an operator unloads it or reloads: the systemd watchdog stops.  A model that is
        unloaded (never asked for yet, or let go by ttl_s or onebitctl unload) has not failed: the next
        request loads it; nor has one whose decoder is restarting."""
        return all(m.state is ModelState.FAILED for m in self.all)

    def health_state(self) -> ChildState:
        """What ``/health`` says of the models: the one model's decoder; with several, ready once
        every preloaded model's first load is over, unless every model has failed."""
        if not self.several:
            state = self.default.decoder.state
            if state is ChildState.READY and self.default.state is ModelState.LOADING:
                return ChildState.STARTING  # its load's probe is under way
            return state
        if not self.settled.is_set():
            return ChildState.STARTING
        if self.all_failed():
            return ChildState.FAILED
        return ChildState.READY

    def unrestorable(self) -> dict[str, str]:
        """The loaded models whose restores spare no prompt, with why: ``/health``'s ``restores_unusable``."""
        loaded = (m for m in self.all if m.state is ModelState.LOADED)
        return {m.name: m.parts.capability.words for m in loaded if not m.parts.capability.handoff}

    def share_refused(self) -> dict[str, str]:
        """The loaded models whose running decoder refused the share route, with why: ``/health``'s."""
        return {m.name: why for m in self.all if m.state is ModelState.LOADED and (why := m.share_refused())}

    def statistics(self) -> ModelsStatistics:
        settings = self._live().models
        return ModelsStatistics(
            default=self.default.name,
            max_loaded=settings.max_loaded,
            memory_budget_mib=settings.memory_budget_mib,
            memory_mib=round(sum(m.memory_mib() for m in self.all if m.state is not ModelState.UNLOADED), 1),
            waiting=sum(len(w) for w in self._waiting.values()),
            swaps=self.swaps,
            models=tuple(m.statistics() for m in self.all),
        )

    def listing(self) -> dict[str, Any]:
        """``GET /v1/models`` with several models: every one, with its state (OpenAI's list, and
        llama-server's router mode's ``status``)."""
        return {
            "object": "list",
            "data": [
                {
                    "id": m.name,
                    "object": "model",
                    "owned_by": "onebitd",
                    "created": int(m.statistics().state_since),
                    "aliases": list(m.spec.aliases),
                    "status": {"value": m.state.value},
                }
                for m in self.all
            ],
        }


class Held:
    """A request's hold on its model (:meth:`Models.use`): taken on entry (waiting for a load when
    the model is not loaded), let go on exit.  A class, not an ``asynccontextmanager``: every
    request enters one, and a generator's machinery would cost as much as the hold itself."""

    __slots__ = ("_any_loaded", "_asked", "_model", "_models", "load_ms", "model")

    def __init__(self, models: Models, asked: Any, any_loaded: bool) -> None:
        self._models = models
        self._asked = asked
        self._any_loaded = any_loaded
        self._model: Model | None = None
        self.model: str | None = None  # the model's name, once known
        self.load_ms: float | None = None  # how long the request waited for its load (None: it did not)

    async def __aenter__(self) -> Model:
        self._model = await self._models._take(self._asked, self, self._any_loaded)
        return self._model

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._model is not None
        self._models._let_go(self._model)
