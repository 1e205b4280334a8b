"""One load of a model: its decoder's client, launcher and Child, the slot pool, the providers, the
hybrid routes and the completions, built whole per load from the model's one-model config
(supervisor/config/modelspec.py) and the load's :class:`~supervisor.models.layout.Layout` (a child, a
client or a provider lives for one load).  What each start admits (supervisor/models/admission.py)
the load keeps: the capability its requests read, the slot context its completions plan with.

Each part reads the live keys from the daemon's :class:`~supervisor.config.live.Settings` at each
use; what a load fixes for its life (the decoder's command line, the slot count, the providers) comes
from the one-model config and the layout.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

from ..config import Config, ExecProviderConfig, LlamaServerProviderConfig, ProviderConfig, locate, modelspec
from ..config.live import Settings
from ..config.modelspec import ModelSpec
from ..llama import openvino
from ..llama.decoder import DecoderClient, SlotContext
from ..llama.llama_server import LlamaServerLauncher, connection_limit, model_alias
from ..llama.slots import SlotPool
from ..prefix.store import PrefixStore
from ..providers import Provider, Providers
from ..providers.base import Checked, Gate
from ..providers.exec import ExecProvider
from ..providers.llama import LlamaServerProvider
from ..providers.seat import Seats, Tenant
from ..providers.worker import WorkerProvider
from ..routes.capability import Capability, Restores
from ..routes.completion import Completions, Hybrid
from ..routes.compute import Placement
from ..routes.file import FileHandoff
from ..routes.share import ShareHandoff, ShareHandshake
from ..routes.stored import StoredPrefixes
from ..supervise.child import Child, OnTransition
from . import admission
from .layout import Layout
from .memory import ModelFile

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


# A load's probe verdict, its words, and whether its llama-servers kept the sliding-window layers
# whole (--swa-full): what a later load takes again unprobed while the last is the same.
Proven = tuple[Restores, str, bool]


class Parts:
    """One load of a model, built whole from its config and layout (the module's docstring)."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        layout: Layout,
        model_file: ModelFile | None,
        runtime_dir: Path,
        settings: Settings,
        check_fidelity: bool,
        on_decoder: OnTransition,
        on_provider: OnTransition | None = None,
        seats: Seats | None = None,
        model_idle: Callable[[], bool] = lambda: True,
        proven: Proven | None = None,
    ) -> None:
        """``layout``: the load's KV layout, decided before it (supervisor/models/layout.py);
        ``model_file``: the model's file as the load read it; ``proven``: the restore probe's verdict
        of the model's earlier loads (Model carries it)."""
        self.config = config = spec.config
        self.name = spec.name
        self.layout = layout
        self.model_file = model_file
        self.runtime_dir = runtime_dir
        self.state_dir = runtime_dir / "state"
        self.settings = settings
        self.check_fidelity = check_fidelity
        self.capability = Capability(spec.name)
        # The probe's verdict, once it ran: every later start of the decoder (a swap back, a restart
        # after a crash) runs the same build, flags and file, so it is taken again unprobed; a
        # capability withdrawn since, or one found with the sliding-window layers kept otherwise (a
        # reload moved the memory budget under model.swa_full = "auto"), is probed anew.
        self._proven = proven if proven is None or proven[2] == layout.swa_full else None
        # The context each decoder slot got, as the decoder's last start said it (after_start).
        self.slot_context: SlotContext | None = None
        # The one client of the decoder: the launcher health-checks through it, and every request,
        # handoff and pass-through uses it.
        self.client = DecoderClient(
            runtime_dir / "decoder.sock", max_connections=connection_limit(config.model.parallel)
        )
        self.launcher = self._launcher(spec)
        self.decoder = Child(
            self.launcher,
            config.decoder.health,
            config.decoder.restart,
            cpu_affinity=config.decoder.cpu_affinity,
            on_transition=on_decoder,
        )
        self.slots = SlotPool(config.model.parallel, settings.queue_limit)
        self.providers = self._providers(settings, seats, model_idle, on_provider)
        self.hybrid = self._hybrid() if config.hybrid.enabled and self.providers.all else None
        self.completions = self._completions()

    @property
    def swa_full(self) -> bool:
        return self.layout.swa_full

    def _launcher(self, spec: ModelSpec) -> LlamaServerLauncher:
        config = self.config
        return LlamaServerLauncher(
            "decoder" if not spec.subdir else f"decoder-{spec.name}",
            config,
            binary=config.decoder.binary,
            client=self.client,
            slot_save_path=self.state_dir,
            threads=config.decoder.threads,
            extra_args=config.decoder.extra_args,
            # The patched decoder keeps its KV on lendable memfd regions only when the share route can run.
            kv_share=share_enabled(config) and config.hybrid.enabled and bool(config.provider),
            kv_unified=self.layout.kv_unified,
            swa_full=self.layout.swa_full,
        )

    def _providers(
        self,
        settings: Settings,
        seats: Seats | None,
        model_idle: Callable[[], bool],
        on_provider: OnTransition | None,
    ) -> Providers:
        """A provider several models name is a seat of one device (providers/seat.py): this model's
        process on it runs only while the model holds it, built afresh for each start."""
        shared = modelspec.shared_providers(settings()) if seats is not None else frozenset()
        return Providers(
            [
                Tenant(seats.get(p.name), self.name, partial(self._provider, p, on_provider), model_idle)
                if seats is not None and p.name in shared
                else self._provider(p, on_provider)
                for p in self.config.provider
            ]
        )

    def _completions(self) -> Completions:
        """The model's completion requests, over its decoder, slots and hybrid routes."""
        config = self.config
        return Completions(
            decoder=self.decoder,
            client=self.client,
            slots=self.slots,
            settings=self.settings.hybrid,
            hybrid=self.hybrid,
            slot_context=self._slot_tokens,
            capability=self.capability,
            prompt_cache_mib=config.cache.ram_mib,
        )

    def _slot_tokens(self) -> int:
        """The tokens one decoder slot holds, prompt and reply: as llama-server said at its start,
        else model.ctx_size / model.parallel, as it divides its context."""
        if self.slot_context is not None:
            return self.slot_context.n_ctx
        return self.config.model.ctx_size // self.config.model.parallel

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
            memory=None if self.model_file is None or self.model_file.shape is None else self.model_file.shape.memory,
            capability=self.capability,
        )

    def _provider(self, spec: ProviderConfig, on_transition: OnTransition | None) -> Provider:
        if isinstance(spec, LlamaServerProviderConfig):
            return LlamaServerProvider(
                spec,
                self.config,
                runtime_dir=self.runtime_dir,
                state_dir=self.state_dir,
                kv_unified=self.layout.kv_unified,
                swa_full=self.layout.swa_full,
                device=self.layout.devices.get(spec.name),
                on_transition=on_transition,
                # The decoder's own build is exact (tests hold its handoffs to identical replies):
                # nothing to measure at start.  Another engine or another binary is measured, and
                # an engine chosen for it (engine "auto") must also be faster than the decoder's.
                gate=self._gate(must_be_faster=spec.engine == "auto") if self._foreign(spec) else None,
            )
        # A program of the user's own: measured unless its config vouches for the decoder's build.
        gate = self._gate() if spec.fidelity_check else None
        if isinstance(spec, ExecProviderConfig):
            return ExecProvider(spec, gate=gate)
        return WorkerProvider(spec, gate=gate, on_transition=on_transition)

    def _foreign(self, spec: LlamaServerProviderConfig) -> bool:
        """Its KV is not the decoder's own build's: another engine (OpenVINO), or a llama-server
        binary other than the decoder's."""
        if openvino.engine_of(spec.engine, spec.binary) != "ggml":
            return True
        decoder = locate.llama_server(self.config.decoder.binary)
        theirs = locate.llama_server(spec.ggml_binary(self.config.decoder.binary))
        return decoder is None or theirs is None or decoder.resolve() != theirs.resolve()

    def _gate(self, *, must_be_faster: bool = False) -> Gate | None:
        """The providers' start-time check (supervisor/models/admission.py), where the daemon runs it;
        ``must_be_faster``: a prefill no faster than the decoder's own engine's is refused too."""
        return partial(self._check, must_be_faster=must_be_faster) if self.check_fidelity else None

    async def _check(self, provider: Provider, *, must_be_faster: bool) -> Checked:
        """``provider``'s start-time check, measured with this load's decoder as it is then."""
        if self.hybrid is None:
            return Checked()  # no hybrid route: nothing will be handed over
        gauge = admission.Gauge(
            decoder=self.decoder,
            client=self.client,
            slots=self.slots,
            state_dir=self.state_dir,
            capability=self.capability,
            handoff=self.hybrid.file,
            rates=self.completions.rates,
            timeout_s=self.settings.hybrid().prefill_timeout_s,
            slot_context=self._slot_tokens(),
            must_be_faster=must_be_faster,
        )
        return await admission.check(provider, gauge)

    async def after_start(self, store_enabled: bool) -> None:
        """After each start of the decoder, before the model takes requests: what it admits
        (supervisor/models/admission.py), kept for the load's requests."""
        start = admission.Start(
            name=self.name,
            table=self.config.model,
            client=self.client,
            slots=self.slots,
            state_dir=self.state_dir,
            slides=not self.layout.swa_full and self.model_file is not None and bool(self.model_file.sliding_window),
        )
        proven = self.proven
        restoring = self.hybrid is not None or store_enabled
        admitted = await admission.admit(start, restoring=restoring, proven=None if proven is None else proven[:2])
        if admitted.slot_context is not None:
            self.slot_context = admitted.slot_context
        if admitted.probed:
            self.capability.withdrawn = None
            if admitted.restores is not Restores.UNPROBED:  # a probe that could not run is tried again
                self._proven = admitted.restores, admitted.why, self.layout.swa_full
        self.capability.set(admitted.restores, admitted.why)

    @property
    def proven(self) -> Proven | None:
        """The probe's verdict for the model's next load to take, unless it was withdrawn since."""
        return self._proven if self.capability.withdrawn is None else None

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
