"""The root of the supervision tree: :class:`Daemon` builds the models, the front and the admin
socket from one config and runs them in order.

    Daemon.run ─ a nursery
    ├── Models.run              the scheduler: loads on demand, unloads (LRU, ttl_s), per model:
    │   └── Model.run           its prefix store; per load: its decoder's Child (llama-server on
    │                           <runtime>/decoder.sock, or <runtime>/model-NAME/), its
    │                           providers, its Completions (supervisor/models/model.py)
    ├── AdminServer.run         <runtime>/admin.sock: onebitctl's verbs
    ├── Front.run               HttpServer on server.host:port; one cancel scope per request
    └── _announce               READY=1 and STATUS= for systemd, once the preloaded models settled

Start order: the runtime directory's lock, then the front's sockets are bound (a port in use
stops onebitd before any child is started), then every model's prefix store is opened and the
preloaded ones (the default model, and those with ``preload``) are loaded, then the front serves
and ``task_status.started`` reports the bound addresses; READY=1 follows once the default model's
decoder is healthy and every provider's first start is over (with several models: once every
preloaded model's first load is over).  Shutdown is the reverse: the front stops accepting and
waits for in-flight requests up to ``server.shutdown_grace_s``, then the nursery is cancelled,
every child is stopped and reaped under a shielded scope, and the sockets and lock onebitd made
are removed.

The running config is one :class:`~supervisor.config.live.Settings`: every part reads the live
keys from it at each use, and a reload swaps it.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import attrs
import trio

from .. import __version__
from .. import config as configuration
from ..admin.verbs import AdminServer
from ..api.front import Front, ProviderReadiness
from ..api.statuspage import StatusPage
from ..api.vertex import Vertex
from ..config import Config, locate, modelspec
from ..config.live import Settings
from ..errors import ConfigError
from ..models.model import Model, ModelState
from ..models.registry import Models
from ..observe import logs
from ..observe.metrics import LiveStatistics, Metrics
from ..observe.routestats import RouteStats
from ..observe.status import DaemonInfo, DaemonStatistics, ModelStatistics, merged_slots, to_wire
from ..prefix.store import PrefixStore
from ..providers.seat import Seats
from ..routeline import RouteLine
from ..supervise.child import Child, ChildState
from ..supervise.notify import Notifier, run_watchdog, watchdog_interval
from . import rundir
from .stores import Stores

log = logging.getLogger("onebit.daemon")


@attrs.frozen
class Started:
    binds: list[str]
    runtime_dir: Path


# How often STATUS= is refreshed for `systemctl status`.
STATUS_INTERVAL_S = 5.0


class Daemon:
    def __init__(
        self,
        config: Config,
        *,
        config_path: str | None = None,
        notifier: Notifier | None = None,
        check_fidelity: bool = True,
    ) -> None:
        """``check_fidelity`` false: providers on another engine are admitted without the start-time
        check (a benchmark or a test that measures fidelity itself)."""
        self.settings = Settings(config)
        self.check_fidelity = check_fidelity
        self.config_path = config_path
        self.notifier = notifier or Notifier("")
        self.runtime_dir = locate.runtime_dir(config.server.runtime_dir, port=config.server.port)
        self.seats = Seats()  # the providers several models name, one device each
        self.models = Models(
            [self._model(spec) for spec in modelspec.specs(config)],
            live=self.settings,
            several=bool(config.model_tables),
        )
        self.route_stats = RouteStats()
        for model in self.models.all:
            model.on_event = self.route_stats.publish
        self.metrics = Metrics(self._metrics_snapshot)
        self.front = Front(
            self.settings.server,
            models=self.models,
            emit=self._on_route_line,
            metrics=self.metrics.render,
            providers=self.provider_readiness,
            # Vertex AI sets AIP_MODE=PREDICTION in the container: onebitd answers its routes, as
            # llama-server does under it (supervisor/api/vertex.py).
            vertex=Vertex.from_environ(os.environ),
        )
        self.front.page = StatusPage(lambda: to_wire(self.statistics()), self.route_stats)
        self.admin = AdminServer(self, self.runtime_dir / locate.ADMIN_SOCKET)
        self.stores = Stores()  # each model's prefix store, opened by Model.run
        self._stop = trio.Event()
        self.ready = trio.Event()  # READY=1 was sent
        self._providers_settled = not self.models.default.parts.provider_children()
        self._started_at = time.time()
        self._started_clock = 0.0
        self.stopping = False
        self._binds: list[str] = []

    def _model(self, spec: modelspec.ModelSpec) -> Model:
        return Model(
            spec,
            runtime_dir=self.runtime_dir,
            settings=self.settings,
            check_fidelity=self.check_fidelity,
            seats=self.seats,
        )

    @property
    def config(self) -> Config:
        """The running config (a reload swaps it)."""
        return self.settings()

    # -- what the admin verbs and the metrics read -------------------------------------------------

    def _on_route_line(self, line: RouteLine) -> None:
        self.route_stats.record(line)
        self.metrics.observe(line)

    def children(self) -> list[Child]:
        return [child for model in self.models.all for child in model.children()]

    def provider_readiness(self) -> ProviderReadiness:
        return ProviderReadiness.of(self._providers_settled, self.models.default.parts.providers.statistics())

    def state(self) -> str:
        if self.stopping:
            return "stopping"
        if self.front.draining:
            return "draining"
        if self.models.several:
            states = {model.state for model in self.models.all}
            if self.models.settled.is_set():
                return "failed" if states == {ModelState.FAILED} else "serving"
            return "loading"
        decoder = self.models.default.decoder.state
        if decoder is ChildState.READY and self._providers_settled:
            return "serving"
        if decoder is ChildState.FAILED:
            return "failed"
        return "loading"

    def statistics(self) -> DaemonStatistics:
        info = DaemonInfo(
            state=self.state(),
            pid=os.getpid(),
            version=__version__,
            started_at=self._started_at,
            uptime_s=round(time.time() - self._started_at, 3),
            config=self.config_path,
            runtime_dir=str(self.runtime_dir),
            binds=tuple(self._binds),
        )
        routes = self.route_stats.snapshot()
        completions = self.models.default.completions
        return DaemonStatistics(
            daemon=info,
            children=tuple(child.statistics() for child in self.children()),
            providers=tuple(p for model in self.models.all for p in model.parts.providers.statistics()),
            slots=merged_slots([model.parts.slots.statistics() for model in self.models.all]),
            inflight=self.front.registry.statistics().inflight,
            restore_unused=sum(model.completions.restore_unused for model in self.models.all),
            routes=routes.routes,
            outcomes=routes.outcomes,
            fallbacks=routes.fallbacks,
            first_byte=routes.first_byte,
            watchers=routes.watchers,
            watch_dropped=routes.watch_dropped,
            watch_closed=routes.watch_closed,
            store=self.models.default.store_statistics(),
            models=self.models.statistics(),
            estimates=routes.estimates,
            costs=completions.rates.statistics(completions.decoder.generation),
        )

    def _metrics_snapshot(self) -> LiveStatistics:
        """/metrics' figures: the slots, store and providers families are the default model's
        (each model's are its ``onebit_model_*`` families)."""
        default = self.models.default
        return LiveStatistics(
            children=tuple(child.statistics() for child in self.children()),
            slots=default.parts.slots.statistics(),
            front=self.front.registry.statistics(),
            restore_unused=sum(model.completions.restore_unused for model in self.models.all),
            store=default.store_statistics(),
            providers=tuple(default.parts.providers.statistics()),
            models=self.models.statistics(),
        )

    def inflight_count(self) -> int:
        return len(self.front.registry.statistics().inflight)

    async def wait_inflight_changed(self) -> None:
        await self.front.registry.wait_changed()

    def start_drain(self) -> None:
        if not self.front.draining:
            log.info("draining: %d request(s) in flight", self.inflight_count())
        self.front.registry.drain()
        self._update_status()

    async def keep_slots(self) -> int:
        """A drain's end: each loaded model's slots that hold long prompts saved into its prefix
        store (supervisor/models/model.py's keep_slots), so another host (a shared store) or this one
        after a restart restores them.  How many were saved."""
        kept = 0
        for model in self.models.all:
            kept += await model.keep_slots(lambda: self.front.draining)
        if kept:
            log.info("drained: %d slot(s) kept in the prefix store", kept)
        return kept

    def resume(self) -> None:
        if self.front.draining and not self.stopping:
            log.info("resuming: taking new requests again")
            self.front.registry.resume()
        self._update_status()

    def store_of(self, name: str | None = None) -> PrefixStore | None:
        """A model's prefix store (``name`` None: the default model's; None: it has none); ClientError
        for a model there is not."""
        return self.models.default.store if name is None else self.models.named(name).store

    async def load(self, name: str) -> ModelStatistics:
        return (await self.models.load(name)).statistics()

    async def unload(self, name: str) -> ModelStatistics:
        return (await self.models.unload(name)).statistics()

    def reload(self) -> dict[str, Any]:
        """Re-read the config file; apply what can change live; name the rest.  Raises ConfigError."""
        if self.config_path is None:
            raise ConfigError(["reload: this daemon was not started from a config file"])
        self.notifier.reloading()
        try:
            try:
                new = configuration.load(self.config_path)
            except ConfigError as exc:
                # Logged here, whoever asked (SIGHUP or onebitctl reload): the operator reads the log.
                for line in exc.lines:
                    log.error("reload refused: %s", line)
                raise
            done = configuration.reload(self.config, new, self.config_path)
            self._apply(done.config)
        finally:
            self._update_status()
        applied, restart = list(done.applied), list(done.restart_needed)
        log.info("reload: applied %s; needs a restart: %s", applied or "nothing", restart or "nothing")
        return {"applied": applied, "restart_needed": restart}

    def _apply(self, config: Config) -> None:
        # The one swap: every part reads the settings at each use.
        self.settings.swap(config)
        logs.setup(config.log.format, config.log.level, children=config.log.children)
        if self.models.several:
            # Models added or removed: the others are not touched.
            wanted = {spec.name: spec for spec in modelspec.specs(config)}
            for name in [m.name for m in self.models.all if m.name not in wanted]:
                self.models.remove(name)
            for name, spec in wanted.items():
                if self.models.get(name) is None:
                    self.models.add(self._model(spec))

    def _update_status(self) -> None:
        state = self.state()
        if state == "draining":
            self.notifier.status(f"draining: {self.inflight_count()} in flight")
        elif state == "serving":
            counts = ", ".join(f"{route} {n}" for route, n in sorted(self.route_stats.routes.items())) or "none yet"
            self.notifier.status(f"serving: {self.inflight_count()} in flight; requests: {counts}")
        else:
            self.notifier.status(f"{state}: decoder {self.models.default.decoder.state.value}")

    # -- the tree ----------------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self, *, task_status: trio.TaskStatus[Started] = trio.TASK_STATUS_IGNORED) -> None:
        lock = rundir.lock_runtime_dir(self.runtime_dir)
        try:
            # Bound before anything that takes time starts: a port in use stops onebitd with one
            # line naming the key, and no child is started for nothing.
            self.front.bind()
        except BaseException:
            (self.runtime_dir / rundir.LOCK_NAME).unlink(missing_ok=True)  # ours while we hold it
            os.close(lock)
            raise
        self._started_clock = trio.current_time()
        clean = False
        try:
            await self.stores.ask_version(self.config)
            async with trio.open_nursery() as nursery:
                await nursery.start(self.models.run, self.stores.open)
                await nursery.start(self.admin.run)
                async with trio.open_nursery() as front_nursery:
                    self._binds = await front_nursery.start(self.front.run)
                    log.info("onebitd %s listening on %s", __version__, ", ".join(self._binds))
                    nursery.start_soon(self._announce)
                    task_status.started(Started(self._binds, self.runtime_dir))
                    await self._stop.wait()
                    await self._drain_for_stop()
                    self.front.stop()
                # The front returned: in-flight requests are done (or past the grace period).
                nursery.cancel_scope.cancel()
            clean = True
        finally:
            self.front.unbind()
            if clean:
                rundir.remove_own_files(self.runtime_dir, self.models.all)
            os.close(lock)
            log.info("stopped")

    async def _drain_for_stop(self) -> None:
        """SIGTERM is a drain with server.shutdown_grace_s, then the stop."""
        self.notifier.stopping()
        self.start_drain()
        self.stopping = True
        log.info(
            "stopping: %d request(s) in flight, up to %gs", self.inflight_count(), self.config.server.shutdown_grace_s
        )
        with trio.move_on_after(self.config.server.shutdown_grace_s):
            await self.front.registry.wait_idle()
            await self.keep_slots()
        if self.inflight_count():
            log.warning("stopping with %d request(s) still in flight after the grace period", self.inflight_count())

    async def _announce(self) -> None:
        """READY=1 once the front is bound, the decoder is healthy (with several models: every
        preloaded model's first load is over) and every provider of a loaded model has had its first
        start (healthy or failed: requests routed before would quietly go plain); then STATUS= and
        the watchdog."""
        if self.models.several:
            await self.models.settled.wait()
            # A model's load is its decoder's: the providers of each model that loaded may still start.
            loaded = [model for model in self.models.all if model.state is ModelState.LOADED]
        else:
            loaded = [self.models.default]
        providers = [provider for model in loaded for provider in model.parts.providers.all]
        for provider in providers:
            await provider.wait_settled()
        self._providers_settled = True
        if not self.models.several:
            await self.models.default.decoder.wait_state(ChildState.READY)
        not_ready = [p for p in providers if not p.ready]
        for provider in not_ready:
            if provider.statistics().refused is not None:
                continue  # its refusal was logged, one line, with why
            why = provider.child.statistics().last_exit if provider.child is not None else None
            log.error(
                "provider %s is not ready (%s): requests take the plain route until it is",
                provider.name,
                why or "its start failed",
            )
        self._providers_settled = True
        names = f"; providers not ready: {', '.join(p.name for p in not_ready)}" if not_ready else ""
        log.info("ready: serving on %s%s", ", ".join(self._binds), names)
        self.notifier.ready(f"serving on {', '.join(self._binds)}{names}")
        self.ready.set()
        interval = watchdog_interval()
        async with trio.open_nursery() as nursery:
            if interval is not None:
                nursery.start_soon(
                    run_watchdog,
                    self.notifier,
                    interval,
                    self._alive,
                )
            while True:
                await trio.sleep(STATUS_INTERVAL_S)
                self._update_status()

    def _alive(self) -> bool:
        """What the systemd watchdog asks (the ping itself proves the loop turns): some model can
        still serve.  One that failed for good does not restart the others; when every one has
        failed, systemd's restart is the only way back."""
        return not self.models.all_failed()
