"""One model the daemon serves: its decoder, slots, providers and routes, loaded and unloaded.

    Model.run ─ the owner of ModelState; per load, a nursery:
        ├── Child(decoder).run      llama-server on <dir>/decoder.sock: spawn, health-gate, restart
        ├── Provider.run            each of its [[provider]]s: its Child, or none (exec)
        └── Completions.run         the prefix store's saves, off the requests' path

A load builds its parts afresh (:class:`Parts`: the decoder's client, launcher and Child, the slot
pool, the providers, the hybrid routes, the completions): a child, a client or a provider lives for
one load.  Its state is :class:`ModelState` and ``TRANSITIONS``, owned by the one task that runs
:meth:`Model.run`; the scheduler (supervisor/models/registry.py) asks through :meth:`Model.want` and waits
with :meth:`Model.wait_state`.

Before an unload the slots whose prompts the prefix store would keep are saved into it (a
conversation whose model was swapped out restores from the store when it comes back instead of
prefilling again); the model's prefix store is the daemon's for its lifetime, not the load's.

Where its files go: ``<runtime_dir>/decoder.sock`` and ``<runtime_dir>/state`` with the single
``[model]`` table, as they always did; ``<runtime_dir>/model-<name>/`` for each of several
(supervisor/config/modelspec.py).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import trio

from ..config import Config, HybridConfig, ModelConfig, ProviderConfig, model_name, modelspec
from ..config import ExecProvider as ExecProviderConfig
from ..config import LlamaServerProvider as LlamaServerProviderConfig
from ..config.modelspec import ModelSpec
from ..errors import DecoderUnavailable, ProviderStateRefused
from ..llama import openvino
from ..llama.decoder import DecoderClient
from ..llama.llama_server import LlamaServerLauncher, connection_limit, model_alias
from ..llama.openvino import UNIFIED_ARGS
from ..llama.slots import SlotPool
from ..observe.status import ModelStatistics
from ..prefix.store import PrefixStore
from ..providers import Provider, Providers
from ..providers.exec import ExecProvider
from ..providers.llama import LlamaServerProvider
from ..providers.seat import Seats, Tenant
from ..providers.worker import WorkerProvider
from ..routes import fidelity
from ..routes.completion import Completions, Hybrid
from ..routes.file import FileHandoff
from ..routes.share import ShareHandoff, ShareHandshake
from ..routes.stored import StoredPrefixes
from ..supervise.child import Child, ChildState
from .memory import rss_mib

log = logging.getLogger("onebit.model")

# The decoder connects back to our share socket right after answering ?action=share; a local
# connect that takes longer than this will not come.
SHARE_CONNECT_TIMEOUT_S = 5.0


def share_enabled(config: Config) -> bool:
    """``ONEBIT_KV_SHARE`` (1 or 0), when set, wins over ``hybrid.mode``."""
    env = os.environ.get("ONEBIT_KV_SHARE")
    if env is not None and env.strip() != "":
        return env.strip() not in ("0", "false", "no", "off")
    return config.hybrid.mode == "share"


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


class Parts:
    """One load of a model: what daemon.py built for its one model, built afresh per load."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        runtime_dir: Path,
        live: Callable[[], Config],
        kv_unified: bool,
        check_fidelity: bool,
        on_decoder: Callable[[Child, ChildState, ChildState, str], None],
        seats: Seats | None = None,
        model_idle: Callable[[], bool] = lambda: True,
    ) -> None:
        config = spec.config
        self.config = config
        self.runtime_dir = runtime_dir
        self.state_dir = runtime_dir / "state"
        self.check_fidelity = check_fidelity
        # The one client of the decoder: the launcher health-checks through it, and every request,
        # handoff and pass-through uses it.
        self.client = DecoderClient(
            runtime_dir / "decoder.sock", max_connections=connection_limit(config.model.parallel)
        )
        self.launcher = LlamaServerLauncher(
            "decoder" if not spec.subdir else f"decoder-{spec.name}",
            config,
            binary=config.decoder.binary,
            client=self.client,
            slot_save_path=self.state_dir,
            threads=config.decoder.threads,
            extra_args=config.decoder.extra_args,
            # The patched decoder keeps its KV on lendable memfd regions only when the share route can run.
            kv_share=share_enabled(config) and config.hybrid.enabled and bool(config.provider),
            kv_unified=kv_unified,
        )
        self.decoder = Child(
            self.launcher,
            config.decoder.health,
            config.decoder.restart,
            cpu_affinity=config.decoder.cpu_affinity,
            on_transition=on_decoder,
        )
        self.slots = SlotPool(config.model.parallel, lambda: live().server.queue_limit)
        # A provider several models name is a seat of one device (providers/seat.py): this model's
        # process on it runs only while the model holds it.
        shared = modelspec.shared_providers(live()) if seats is not None else frozenset()
        self.providers = Providers(
            [
                Tenant(seats.get(p.name), spec.name, partial(self._shared, p), model_idle)
                if seats is not None and p.name in shared
                else self._provider(p, kv_unified)
                for p in config.provider
            ]
        )
        self.hybrid: Hybrid | None = None
        if config.hybrid.enabled and self.providers.all:
            self.hybrid = Hybrid(
                providers=self.providers,
                file=FileHandoff(
                    client=self.client,
                    state_dir=self.state_dir,
                    model=model_alias(config),
                    n_ctx=config.model.ctx_size,
                ),
                share=self._share_handoff() if share_enabled(config) else None,
            )

        def hybrid_settings() -> HybridConfig:
            return live().hybrid

        self.completions = Completions(
            decoder=self.decoder,
            client=self.client,
            slots=self.slots,
            settings=hybrid_settings,
            hybrid=self.hybrid,
            slot_context=config.model.ctx_size // config.model.parallel,
        )

    def _share_handoff(self) -> ShareHandoff:
        return ShareHandoff(
            client=self.client,
            handshake=ShareHandshake(
                client=self.client, runtime_dir=self.runtime_dir, connect_timeout_s=SHARE_CONNECT_TIMEOUT_S
            ),
            model=model_alias(self.config),
            n_ctx=self.config.model.ctx_size,
        )

    def _shared(self, spec: ProviderConfig) -> Provider:
        """A shared provider's process for one start: the model's layout as chosen by then."""
        return self._provider(spec, self.launcher.kv_unified)

    def _provider(self, spec: ProviderConfig, kv_unified: bool) -> Provider:
        if isinstance(spec, LlamaServerProviderConfig):
            return LlamaServerProvider(
                spec,
                self.config,
                runtime_dir=self.runtime_dir,
                state_dir=self.state_dir,
                kv_unified=kv_unified,
                # The ggml engine is the decoder's own: its handoffs are exact (tests hold them to
                # identical replies), nothing to measure at start.
                gate=self._fidelity_gate
                if self.check_fidelity and openvino.engine_of(spec.engine, spec.binary) != "ggml"
                else None,
            )
        if isinstance(spec, ExecProviderConfig):
            return ExecProvider(spec)
        return WorkerProvider(spec)

    async def _fidelity_gate(self, provider: Provider) -> str | None:
        """A provider's start-time check (supervisor/routes/fidelity.py): a few prompts through the decoder's
        three paths, in a slot held like a request's.  None: admitted; else why it is refused.
        Raises ProviderError when it cannot finish (the decoder or the provider went away)."""
        if self.hybrid is None:
            return None  # no hybrid route: nothing will be handed over
        await self.decoder.wait_state(ChildState.READY)
        probe = fidelity.Probe(
            client=self.client, handoff=self.hybrid.file, timeout_s=self.config.hybrid.prefill_timeout_s
        )
        prompts = [await probe.tokens(text) for text in fidelity.START_PROMPTS]
        started = trio.current_time()
        async with self.slots.hold() as slot:
            try:
                samples = [
                    await probe.sample(provider, slot, tokens, req=f"fidelity-{provider.name}-{i}")
                    for i, tokens in enumerate(prompts)
                ]
            except ProviderStateRefused as exc:
                return str(exc)
            finally:
                self.slots.forget(slot)
        verdict = fidelity.judge(samples)
        if not verdict.ok:
            return f"{verdict.summary()}: over the bound"
        log.info("%s: admitted in %.1fs: %s", provider.name, trio.current_time() - started, verdict.summary())
        return None

    def llama_providers(self) -> list[LlamaServerProvider]:
        """Its llama-server providers; of one several models name, this model's last start's (its
        device and layout are chosen on it before the first start, and the fingerprint names it)."""
        providers = [p.last if isinstance(p, Tenant) else p for p in self.providers.all]
        return [p for p in providers if isinstance(p, LlamaServerProvider)]

    def provider_children(self) -> list[Child]:
        """The children of the providers that have one (exec providers start a process per job)."""
        return [p.child for p in self.providers.all if p.child is not None]

    def sockets(self) -> list[Path]:
        return [self.client.socket, *(p.launcher.socket for p in self.llama_providers())]


# How the daemon opens a model's prefix store (it knows the decoder's version): open for the
# model's lifetime in the daemon, closed on the way out.
StoreOpener = Callable[["Model"], contextlib.AbstractAsyncContextManager[PrefixStore]]


class Model:
    def __init__(
        self,
        spec: ModelSpec,
        *,
        runtime_dir: Path,
        live: Callable[[], Config],
        estimate_mib: float = 0.0,
        check_fidelity: bool = True,
        seats: Seats | None = None,
    ) -> None:
        """``runtime_dir``: the daemon's; ``live``: the daemon's config now (a reload swaps it)."""
        self.spec = spec
        self.name = spec.name
        self.dir = runtime_dir / spec.subdir if spec.subdir else runtime_dir
        self._live = live
        self.check_fidelity = check_fidelity
        self.seats = seats
        self.estimate_mib = estimate_mib
        self.kv_unified = False  # decided by choose_layout(), before any child starts
        self._state = ModelState.UNLOADED
        self._state_since = time.time()
        self._changed = trio.Event()
        self._wake = trio.Event()
        self._wanted = False
        self.users = 0
        self.loads = 0
        self.last_load_ms: float | None = None  # its decoder's spawn to healthy
        self.last_unload_ms: float | None = None  # its slots kept and its children stopped
        self.last_used: float | None = None  # trio clock: the scheduler's LRU order
        self.loaded_at: float | None = None  # trio clock: its last load's end (idle since, if unused since)
        self._last_used_wall: float | None = None
        self.store = PrefixStore.disabled("not opened yet", level=logging.DEBUG)
        # Called after every transition: the scheduler's (Models.kick) once it holds the model.
        self.on_change: Callable[[], None] = lambda: None
        self.parts = self._parts()

    def _parts(self) -> Parts:
        return Parts(
            self.spec,
            runtime_dir=self.dir,
            live=self._live,
            kv_unified=self.kv_unified,
            check_fidelity=self.check_fidelity,
            on_decoder=self._on_decoder,
            seats=self.seats,
            model_idle=lambda: self.users == 0,
        )

    # -- what others read ----------------------------------------------------------------------------

    @property
    def state(self) -> ModelState:
        return self._state

    @property
    def table(self) -> ModelConfig:
        """This model's [[model]] table as the running config has it now (ttl_s, pin are live)."""
        return _table_now(self._live(), self.spec)

    @property
    def decoder(self) -> Child:
        return self.parts.decoder

    @property
    def completions(self) -> Completions:
        return self.parts.completions

    @property
    def client(self) -> DecoderClient:
        return self.parts.client

    def children(self) -> list[Child]:
        return [self.parts.decoder, *self.parts.provider_children()]

    def memory_mib(self) -> float:
        """Measured while loaded (the decoder's and its providers' RSS), else the estimate."""
        if self._state is ModelState.LOADED:
            measured = [rss_mib(child.pid) for child in self.children()]
            known = [m for m in measured if m is not None]
            if known:
                return sum(known)
        return self.estimate_mib

    def statistics(self) -> ModelStatistics:
        table = self.table
        return ModelStatistics(
            name=self.name,
            aliases=self.spec.aliases,
            state=self._state.value,
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
            state_since=self._state_since,
            slots=self.parts.slots.statistics(),
            providers=tuple(self.parts.providers.statistics()),
            store=self.store.statistics(),
        )

    async def wait_state(self, *states: ModelState) -> ModelState:
        while self._state not in states:
            await self._changed.wait()
        return self._state

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def check_serving(self) -> None:
        """Raise DecoderUnavailable (503) unless requests may go to it now."""
        if self._state is ModelState.LOADED:
            return
        if self._state is ModelState.FAILED:
            words = f"model {self.name} has failed ({self.decoder.statistics().last_exit}); see onebitd's log"
        else:
            words = f"model {self.name} is {self._state.value}; try again shortly"
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
        old = self._state
        if new not in TRANSITIONS[old]:
            raise AssertionError(f"model {self.name}: illegal transition {old.value} -> {new.value}")
        self._state = new
        self._state_since = time.time()
        log.info("model %s: %s -> %s%s", self.name, old.value, new.value, f" ({why})" if why else "")
        self._changed.set()
        self._changed = trio.Event()
        self.on_change()

    def _on_decoder(self, _child: Child, _old: ChildState, _new: ChildState, _why: str) -> None:
        self._wake.set()

    async def _woken(self) -> None:
        await self._wake.wait()
        self._wake = trio.Event()

    async def choose_layout(self) -> None:
        """Before its first start: each OpenVINO provider's device (its runtime's list), then one KV
        layout for every llama-server child of the model.  A provider on the static path (an NPU)
        writes files with one KV stream, which only a unified-KV decoder restores
        (supervisor/llama/openvino.py)."""
        providers = self.parts.llama_providers()
        for provider in providers:
            if provider.engine == "openvino" and provider.device is None:
                await provider.choose_device()
        self.kv_unified = any(p.static for p in providers if p.refused is None)
        if self.kv_unified:
            log.info("a provider takes the static path: every llama-server runs with %s", " ".join(UNIFIED_ARGS))
        self.parts.launcher.kv_unified = self.kv_unified
        for provider in providers:
            provider.launcher.kv_unified = self.kv_unified

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
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(parts.decoder.run)
                for provider in parts.providers.all:
                    await nursery.start(provider.run)
                stored = StoredPrefixes(client=parts.client, state_dir=parts.state_dir, store=self.store)
                await nursery.start(parts.completions.run, stored)
                # Unwanted, it goes on serving the requests that hold it: none is unloaded under it.
                while self._wanted or self.users:
                    decoder = parts.decoder.state
                    if decoder is ChildState.READY and self._state is ModelState.LOADING:
                        self.loads += 1
                        self.last_load_ms = (trio.current_time() - began) * 1000
                        self.loaded_at = trio.current_time()
                        self._set(ModelState.LOADED, f"in {self.last_load_ms:.0f} ms")
                    elif decoder is ChildState.FAILED and self._state is not ModelState.FAILED:
                        self._set(ModelState.FAILED, parts.decoder.statistics().last_exit or "its decoder failed")
                    elif decoder in (ChildState.BACKOFF, ChildState.STARTING) and self._state is ModelState.LOADED:
                        began = trio.current_time()
                        self._set(ModelState.LOADING, "its decoder is restarting")
                    await self._woken()
                self._set(ModelState.UNLOADING, "no longer wanted")
                unloading = trio.current_time()
                if parts.decoder.state is ChildState.READY:
                    await self._keep_slots(stored)
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
                self.parts = self._parts()

    async def _keep_slots(self, stored: StoredPrefixes) -> None:
        """Before an unload: each slot whose prompt the store would keep (and does not hold yet) is
        saved into it, awaited, so that the conversation restores from the store when its model is
        back.  No request holds a slot now (the scheduler unloads only an unused model)."""
        if not stored.enabled:
            return
        slots = self.parts.slots
        kept = 0
        for slot in range(slots.n_slots):
            tokens = slots.holds(slot).tokens
            if not tokens or not stored.store.wants(tokens):
                continue
            path = await stored.save(slot, f"unload-{self.name}-{slot}")
            if path is not None and await self.store.put_file(tokens, path):
                kept += 1
        if kept:
            log.info("model %s: %d slot(s) kept in the prefix store before unloading", self.name, kept)


def _table_now(config: Config, spec: ModelSpec) -> ModelConfig:
    """What the running config says of a model now, by name (a reload swaps the config whole)."""
    if not config.model_tables:
        return config.model
    for table in config.model_tables:
        # A name or an alias says it without a look at the file system (model_name's stem).
        if (table.name or table.alias or model_name(table)) == spec.name:
            return table
    return spec.table
