"""One load of a model: its decoder's client, launcher and Child, the slot pool, the providers, the
hybrid routes and the completions, built afresh per load (a child, a client or a provider lives for
one load); the providers' start-time check; the slots kept in the prefix store before an unload.

Each part reads the live keys from the daemon's :class:`~supervisor.config.live.Settings` at each
use; what a load fixes for its life (the decoder's command line, the slot count, the providers) comes
from the model's one-model config (supervisor/config/modelspec.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

import trio

from ..config import Config, ExecProviderConfig, LlamaServerProviderConfig, ProviderConfig, locate, modelspec
from ..config.live import Settings
from ..config.modelspec import ModelSpec
from ..errors import DecoderError, ProviderStateRefused
from ..llama import decoder as decoder_api
from ..llama import openvino
from ..llama.decoder import DecoderClient, SlotContext
from ..llama.llama_server import LlamaServerLauncher, connection_limit, model_alias
from ..llama.slots import SlotPool
from ..prefix.store import PrefixStore
from ..providers import Provider, Providers
from ..providers.exec import ExecProvider
from ..providers.llama import LlamaServerProvider
from ..providers.seat import Seats, Tenant
from ..providers.worker import WorkerProvider
from ..routes import capability, fidelity
from ..routes.capability import Capability, Restores
from ..routes.completion import Completions, Hybrid
from ..routes.compute import Placement
from ..routes.file import FileHandoff
from ..routes.handover import learn
from ..routes.share import ShareHandoff, ShareHandshake
from ..routes.stored import StoredPrefixes
from ..supervise.child import Child, ChildState, OnTransition
from . import layout, memory

log = logging.getLogger("onebit.model")

# What each verdict means for the model's requests, in its load's log line.
_VERDICT_WORDS = {
    Restores.WHOLE: "the hybrid routes and the prefix store are on",
    Restores.PREFIX: "the file route hands over the prompt less its last token; the prefix store is off",
    Restores.NONE: "the hybrid routes and the prefix store are off (fallback=restore-unusable)",
    Restores.UNPROBED: "the routes run unproven, each handoff checked after",
}

# The decoder connects back to our share socket right after answering ?action=share; a local
# connect that takes longer than this will not come.
SHARE_CONNECT_TIMEOUT_S = 5.0


def share_enabled(config: Config) -> bool:
    """``ONEBIT_KV_SHARE`` (1 or 0), when set, wins over ``hybrid.mode``."""
    env = os.environ.get("ONEBIT_KV_SHARE")
    if env is not None and env.strip() != "":
        return env.strip() not in ("0", "false", "no", "off")
    return config.hybrid.mode == "share"


class Parts:
    def __init__(
        self,
        spec: ModelSpec,
        *,
        runtime_dir: Path,
        settings: Settings,
        kv_unified: bool,
        check_fidelity: bool,
        on_decoder: OnTransition,
        on_provider: OnTransition | None = None,
        seats: Seats | None = None,
        model_idle: Callable[[], bool] = lambda: True,
        proven: tuple[Restores, str] | None = None,
    ) -> None:
        config = spec.config
        self.config = config
        self.runtime_dir = runtime_dir
        self.state_dir = runtime_dir / "state"
        self.check_fidelity = check_fidelity
        self.on_provider = on_provider  # each provider child's moves
        self.settings = settings
        self.name = spec.name
        # The model's file, read once for the load; whether every llama-server of this load keeps the
        # sliding-window layers whole, and what its restores can do (proven by after_start's probe).
        self.model_file = memory.read_model(spec)
        self.swa_full = layout.swa_full(spec, self.model_file, settings().models.memory_budget_mib)
        self.capability = Capability(spec.name)
        # The probe's verdict, once it ran: every later start of the decoder (a swap back, a restart
        # after a crash) runs the same build, flags and file, so it is taken again unprobed; a
        # capability withdrawn since is probed anew.  ``proven``: its earlier loads' (Model carries it).
        self._proven = proven
        # What llama-server says each slot holds, once it has started (after_start).
        self.slot_context: SlotContext | None = None
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
            swa_full=self.swa_full,
        )
        self.decoder = Child(
            self.launcher,
            config.decoder.health,
            config.decoder.restart,
            cpu_affinity=config.decoder.cpu_affinity,
            on_transition=on_decoder,
        )
        self.slots = SlotPool(config.model.parallel, settings.queue_limit)
        # A provider several models name is a seat of one device (providers/seat.py): this model's
        # process on it runs only while the model holds it.
        shared = modelspec.shared_providers(settings()) if seats is not None else frozenset()
        self.providers = Providers(
            [
                Tenant(seats.get(p.name), spec.name, partial(self._shared, p), model_idle)
                if seats is not None and p.name in shared
                else self._provider(p, kv_unified)
                for p in config.provider
            ]
        )
        self.hybrid = self._hybrid() if config.hybrid.enabled and self.providers.all else None
        self.completions = self._completions()

    def _completions(self) -> Completions:
        """The model's completion requests, over its decoder, slots and hybrid routes."""
        config = self.config
        return Completions(
            decoder=self.decoder,
            client=self.client,
            slots=self.slots,
            settings=self.settings.hybrid,
            hybrid=self.hybrid,
            slot_context=config.model.ctx_size // config.model.parallel,
            capability=self.capability,
            prompt_cache=config.cache.ram_mib != 0,
        )

    def _hybrid(self) -> Hybrid:
        """The hybrid routes' parts: the providers, the file handoff, and the share one when on."""
        config = self.config
        return Hybrid(
            providers=self.providers,
            file=FileHandoff(
                client=self.client,
                state_dir=self.state_dir,
                model=model_alias(config),
                n_ctx=config.model.ctx_size,
                capability=self.capability,
            ),
            share=self._share_handoff() if share_enabled(config) else None,
            placement=Placement(config.decoder.cpu_affinity, {p.name: p.cpu_affinity for p in config.provider}),
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
                swa_full=self.swa_full,
                on_transition=self.on_provider,
                # The decoder's own build is exact (tests hold its handoffs to identical replies):
                # nothing to measure at start.  Another engine or another binary is measured.
                gate=self._fidelity_gate if self.check_fidelity and self._foreign(spec) else None,
            )
        # A program of the user's own: measured unless its config vouches for the decoder's build.
        gate = self._fidelity_gate if self.check_fidelity and spec.fidelity_check else None
        if isinstance(spec, ExecProviderConfig):
            return ExecProvider(spec, gate=gate)
        return WorkerProvider(spec, gate=gate, on_transition=self.on_provider)

    def _foreign(self, spec: LlamaServerProviderConfig) -> bool:
        """Its KV is not the decoder's own build's: another engine (OpenVINO), or a llama-server
        binary other than the decoder's."""
        if openvino.engine_of(spec.engine, spec.binary) != "ggml":
            return True
        decoder = locate.llama_server(self.config.decoder.binary)
        theirs = locate.llama_server(spec.ggml_binary(self.config.decoder.binary))
        return decoder is None or theirs is None or decoder.resolve() != theirs.resolve()

    async def _fidelity_gate(self, provider: Provider) -> str | None:
        """A provider's start-time check (supervisor/routes/fidelity.py): a few prompts through the decoder's
        three paths, in a slot held like a request's.  None: admitted; else why it is refused.
        Raises ProviderError when it cannot finish (the decoder or the provider went away)."""
        if self.hybrid is None:
            return None  # no hybrid route: nothing will be handed over
        await self.decoder.wait_state(ChildState.READY)
        # The probe first (it may need the only slot), and nothing to measure where nothing restores.
        await self.capability.known.wait()
        if not self.capability.handoff:
            return None
        probe = fidelity.Probe(
            client=self.client, handoff=self.hybrid.file, timeout_s=self.settings.hybrid().prefill_timeout_s
        )
        n_ctx = self.completions.slot_context
        prompts = fidelity.fitting([await probe.tokens(text) for text in fidelity.GATE_PROMPTS], n_ctx)
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
        self._learn(provider, samples)
        verdict = fidelity.judge(samples)
        if not verdict.ok:
            return f"{verdict.summary()}: over the bound"
        log.info("provider %s: admitted in %.1fs: %s", provider.name, trio.current_time() - started, verdict.summary())
        if isinstance(provider, LlamaServerProvider | ExecProvider | WorkerProvider):
            provider.admitted = verdict.summary()  # onebitctl status and the status page show it
        return None

    def _learn(self, provider: Provider, samples: list[fidelity.Sample]) -> None:
        """The start-time check's prefills, cold on the decoder and handed over from the provider,
        are the rates' first measurements: on shared cores a provider is taken only where it is
        measured cheaper, and nothing else would measure it first."""
        rates = self.completions.rates
        for sample in samples:
            rates.observe_decoder(self.decoder.generation, sample.n_tokens, sample.cold_ms)
            if sample.outcome is not None and sample.outcome.ok:
                learn(rates, provider.name, sample.n_tokens, sample.outcome)

    async def after_start(self, store_enabled: bool) -> None:
        """After each start of the decoder, before the model takes requests: the context each slot
        really got, and what a restore can do (supervisor/routes/capability.py), each said once."""
        await self._read_context()
        if self.hybrid is None and not store_enabled:
            self.capability.set(Restores.UNPROBED, "nothing is restored here (no provider, no prefix store)")
            log.info("model %s: no restore probe: %s", self.name, self.capability.why)
            return
        if self._proven is not None and self.capability.withdrawn is None:
            self.capability.set(*self._proven)
            log.debug("model %s: restores %s, as its first start's probe found", self.name, self._proven[0].value)
            return
        self.capability.withdrawn = None
        await self._probe()
        if self.capability.restores is not Restores.UNPROBED:  # a probe that could not run is tried again
            self._proven = self.capability.restores, self.capability.why

    @property
    def proven(self) -> tuple[Restores, str] | None:
        """The probe's verdict for the model's next load to take, unless it was withdrawn since."""
        return self._proven if self.capability.withdrawn is None else None

    async def _read_context(self) -> None:
        try:
            found = await decoder_api.context(self.client)
        except DecoderError as exc:
            log.warning("model %s: cannot read the decoder's slot context: %s", self.name, exc)
            return
        if found is None:
            return
        self.slot_context = found
        self.completions.slot_context = found.n_ctx
        model = self.config.model
        asked = model.ctx_size // model.parallel
        if found.n_ctx < asked:
            train = f" of {found.n_ctx_train}" if found.n_ctx_train is not None else ""
            log.warning(
                "model %s: model.ctx_size = %d over model.parallel = %d asks %d tokens a slot, over the model's"
                " training context%s: each slot got %d tokens",
                self.name,
                model.ctx_size,
                model.parallel,
                asked,
                train,
                found.n_ctx,
            )

    async def _probe(self) -> None:
        n_ctx = self.slot_context.n_ctx if self.slot_context is not None else None
        try:
            tokens = await capability.prompt_tokens(self.client, capability.probe_length(n_ctx))
        except DecoderError as exc:
            self.capability.set(Restores.UNPROBED, f"the probe could not tokenize: {exc}")
        else:
            async with self.slots.hold() as slot:
                try:
                    self.capability.set(*await capability.probe(self.client, slot, tokens, self.state_dir))
                finally:
                    self.slots.forget(slot)
        found = self.capability
        hint = ""
        if found.restores is Restores.NONE and not self.swa_full and self._slides():
            hint = " (a sliding-window model: model.swa_full = true would keep its whole cache)"
        log.log(
            logging.WARNING if found.restores is Restores.NONE else logging.INFO,
            "model %s: restores %s: %s; %s%s",
            self.name,
            found.restores.value,
            found.why,
            _VERDICT_WORDS[found.restores],
            hint,
        )

    def _slides(self) -> bool:
        """The model's file has a sliding window (as this load read it)."""
        return self.model_file is not None and bool(self.model_file.sliding_window)

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

    def stored_prefixes(self, store: PrefixStore | None, rescan_s: float) -> StoredPrefixes | None:
        """The model's prefix store as this load's requests meet it; None where it has none."""
        if store is None:
            return None
        return StoredPrefixes(
            client=self.client, state_dir=self.state_dir, store=store, capability=self.capability, rescan_s=rescan_s
        )

    async def keep_slots(self, stored: StoredPrefixes, name: str, go_on: Callable[[], bool] = lambda: True) -> int:
        """Before an unload or at a drain's end: each slot whose prompt the store would keep (and
        does not hold yet) is saved into it, awaited, so that the conversation restores from the
        store when its model is back, or on another host (instead of prefilling again).  No request
        holds a slot now (the scheduler unloads only an unused model; a drain waits for its
        in-flight requests first, and ``go_on`` says before each slot that it still drains: a
        resume lets requests in again).  How many slots it saved."""
        if not stored.enabled:
            return 0
        kept = 0
        for slot in range(self.slots.n_slots):
            if not go_on():
                break
            tokens = self.slots.holds(slot).tokens
            if not tokens or not stored.store.wants(tokens):
                continue
            path = await stored.save(slot, f"unload-{name}-{slot}")
            if path is not None and await stored.store.put_file(tokens, path):
                kept += 1
        if kept:
            log.info("model %s: %d slot(s) kept in the prefix store", name, kept)
        return kept
