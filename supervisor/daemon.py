"""onebitd: the root of the supervision tree.

    onebitd (trio.run) ─ nursery
    ├── signals                     SIGTERM/SIGINT: stop accepting, finish in-flight, stop children;
    │                               SIGHUP: reload
    └── Daemon.run ─ the KV layout (_choose_layout), the prefix store (open_prefix_store), a nursery
        ├── Child(decoder).run      llama-server on <runtime>/decoder.sock: spawn, health-gate, restart
        ├── Provider.run            each [[provider]] in order: its Child (llama-server, worker) or none (exec)
        ├── Completions.run         with StoredPrefixes.run: the prefix store's saves, off the requests' path
        ├── AdminServer.run         <runtime>/admin.sock: onebitctl's verbs
        ├── Front.run               HttpServer on server.host:port; one cancel scope per request
        └── _announce               READY=1 and STATUS= for systemd, once the decoder and providers settled

Start order: the runtime directory's lock, then the front's sockets are bound (a port in use
stops onebitd before any child is started), then the OpenVINO providers' devices are asked for and
one KV layout chosen, the prefix store is opened, the decoder and the providers are spawned, then
the front serves and ``task_status.started`` reports the bound addresses; READY=1 follows once the
decoder is healthy and every provider's first start is over.  Shutdown is the reverse: the front
stops accepting and waits for in-flight requests up to ``server.shutdown_grace_s``, then the
nursery is cancelled, every child is stopped and reaped under a shielded scope, and the sockets
and lock onebitd made are removed.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from . import __version__, fidelity, locate, logs, openvino
from . import config as configuration
from .admin import AdminServer
from .child import Child, ChildState
from .completion import Completions, Hybrid
from .config import Config, ProviderConfig
from .config import ExecProvider as ExecProviderConfig
from .config import LlamaServerProvider as LlamaServerProviderConfig
from .decoder import DecoderClient
from .errors import ChildError, ConfigError, ListenError, ProviderStateRefused, RuntimeDirInUse
from .front import Front, ProviderReadiness
from .llama_server import LlamaServerLauncher, connection_limit, model_alias, server_version
from .metrics import LiveStatistics, Metrics
from .notify import Notifier, run_watchdog, watchdog_interval
from .openvino import UNIFIED_ARGS
from .prefix.store import PrefixStore, open_prefix_store
from .providers import Provider, Providers
from .providers.exec import ExecProvider
from .providers.llama import LlamaServerProvider
from .providers.worker import WorkerProvider
from .routeline import RouteLine
from .routes.file import FileHandoff
from .routes.share import ShareHandoff, ShareHandshake
from .routes.stored import StoredPrefixes
from .routestats import RouteStats
from .slots import SlotPool
from .status import DaemonInfo, DaemonStatistics
from .vertex import Vertex

log = logging.getLogger("onebit.daemon")

DEFAULT_CONFIG = "/etc/onebit/onebit.toml"


# The decoder connects back to our share socket right after answering ?action=share; a local
# connect that takes longer than this will not come.
SHARE_CONNECT_TIMEOUT_S = 5.0


def share_enabled(config: Config) -> bool:
    """``ONEBIT_KV_SHARE`` (1 or 0), when set, wins over ``hybrid.mode``."""
    env = os.environ.get("ONEBIT_KV_SHARE")
    if env is not None and env.strip() != "":
        return env.strip() not in ("0", "false", "no", "off")
    return config.hybrid.mode == "share"


@attrs.frozen
class Started:
    binds: list[str]
    runtime_dir: Path


LOCK_NAME = "onebitd.lock"


def lock_runtime_dir(path: Path) -> int:
    """Hold ``onebitd.lock`` for our lifetime: a second daemon on the same directory would remove
    the first one's state files and sockets.  Returns the fd (the lock goes with the process)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise RuntimeDirInUse(
            f"server.runtime_dir: another onebitd (pid {holder}) is using {path}; "
            "give this one a runtime directory of its own"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def prepare_runtime_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    # Whatever a crashed daemon left here (sockets, state files) belongs to no live request.
    state = path / "state"
    if state.is_dir():
        for leftover in state.iterdir():
            # Files, and the links a prefix-store restore exposes (dangling once the store moved on).
            if leftover.is_symlink() or leftover.is_file():
                leftover.unlink(missing_ok=True)
    for leftover in path.glob("share-*.sock"):
        leftover.unlink(missing_ok=True)


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
        self.config = config
        self.check_fidelity = check_fidelity
        self.config_path = config_path
        self.notifier = notifier or Notifier("")
        self.runtime_dir = locate.runtime_dir(config.server.runtime_dir)
        # The one client of the decoder: the launcher health-checks through it, and every request,
        # handoff and pass-through uses it.
        self.client = DecoderClient(
            self.runtime_dir / "decoder.sock", max_connections=connection_limit(config.model.parallel)
        )
        self.launcher = LlamaServerLauncher(
            "decoder",
            config,
            binary=config.decoder.binary,
            client=self.client,
            slot_save_path=self.runtime_dir / "state",
            threads=config.decoder.threads,
            extra_args=config.decoder.extra_args,
            # The patched decoder keeps its KV on lendable memfd regions only when the share route can run.
            kv_share=share_enabled(config) and config.hybrid.enabled and bool(config.provider),
        )
        self.decoder = Child(
            self.launcher,
            config.decoder.health,
            config.decoder.restart,
            cpu_affinity=config.decoder.cpu_affinity,
        )
        self.slots = SlotPool(config.model.parallel, lambda: self.config.server.queue_limit)
        self.state_dir = self.runtime_dir / "state"
        self.providers = Providers([self._provider(spec) for spec in config.provider])
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
        self.completions = Completions(
            decoder=self.decoder,
            client=self.client,
            slots=self.slots,
            settings=lambda: self.config.hybrid,
            hybrid=self.hybrid,
            slot_context=config.model.ctx_size // config.model.parallel,
        )
        self.route_stats = RouteStats()
        self.metrics = Metrics(self._metrics_snapshot)
        self.front = Front(
            lambda: self.config.server,
            decoder=self.decoder,
            client=self.client,
            completions=self.completions,
            emit=self._on_route_line,
            metrics=self.metrics.render,
            providers=self.provider_readiness,
            # Vertex AI sets AIP_MODE=PREDICTION in the container: onebitd answers its routes, as
            # llama-server does under it (supervisor/vertex.py).
            vertex=Vertex.from_environ(os.environ),
        )
        self.admin = AdminServer(self, self.runtime_dir / "admin.sock")
        self.store = PrefixStore.disabled("not opened yet", level=logging.DEBUG)
        self.kv_unified = False  # decided by run(), before any child starts
        self._stop = trio.Event()
        # Every provider's first start is over (healthy or failed); then READY=1, /health ok.
        self._providers_settled = not self._provider_children()
        self.ready = trio.Event()  # READY=1 was sent
        self._started_at = time.time()
        self._started_clock = 0.0
        self.stopping = False
        self._binds: list[str] = []

    def _share_handoff(self) -> ShareHandoff:
        return ShareHandoff(
            client=self.client,
            handshake=ShareHandshake(
                client=self.client,
                runtime_dir=self.runtime_dir,
                connect_timeout_s=SHARE_CONNECT_TIMEOUT_S,
            ),
            model=model_alias(self.config),
            n_ctx=self.config.model.ctx_size,
        )

    def _provider(self, spec: ProviderConfig) -> Provider:
        if isinstance(spec, LlamaServerProviderConfig):
            return LlamaServerProvider(
                spec,
                self.config,
                runtime_dir=self.runtime_dir,
                state_dir=self.state_dir,
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
        """A provider's start-time check (supervisor/fidelity.py): a few prompts through the decoder's
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

    # -- what the admin verbs and the metrics read -------------------------------------------------

    def _on_route_line(self, line: RouteLine) -> None:
        self.route_stats.record(line)
        self.metrics.observe(line)

    def children(self) -> list[Child]:
        return [self.decoder, *self._provider_children()]

    def _provider_children(self) -> list[Child]:
        """The children of the providers that have one (exec providers start a process per job)."""
        return [p.child for p in self.providers.all if p.child is not None]

    def provider_readiness(self) -> ProviderReadiness:
        return ProviderReadiness(
            settled=self._providers_settled,
            not_ready=tuple(p.name for p in self.providers.all if not p.ready),
        )

    def state(self) -> str:
        if self.stopping:
            return "stopping"
        if self.front.draining:
            return "draining"
        decoder = self.decoder.state
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
        return DaemonStatistics(
            daemon=info,
            children=tuple(child.statistics() for child in self.children()),
            providers=tuple(self.providers.statistics()),
            slots=self.slots.statistics(),
            inflight=self.front.statistics().inflight,
            restore_unused=self.completions.restore_unused,
            routes=routes.routes,
            outcomes=routes.outcomes,
            fallbacks=routes.fallbacks,
            first_byte=routes.first_byte,
            watchers=routes.watchers,
            watch_dropped=routes.watch_dropped,
            store=self.store.statistics(),
        )

    def _metrics_snapshot(self) -> LiveStatistics:
        return LiveStatistics(
            children=tuple(child.statistics() for child in self.children()),
            slots=self.slots.statistics(),
            front=self.front.statistics(),
            restore_unused=self.completions.restore_unused,
            store=self.store.statistics(),
            providers=tuple(self.providers.statistics()),
        )

    def inflight_count(self) -> int:
        return len(self.front.statistics().inflight)

    async def wait_inflight_changed(self) -> None:
        await self.front.wait_inflight_changed()

    def start_drain(self) -> None:
        if not self.front.draining:
            log.info("draining: %d request(s) in flight", self.inflight_count())
        self.front.drain()
        self._update_status()

    def resume(self) -> None:
        if self.front.draining and not self.stopping:
            log.info("resuming: taking new requests again")
            self.front.resume()
        self._update_status()

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
        # The one swap: the front, the completions and the slots read self.config at each request.
        self.config = config
        logs.setup(config.log.format, config.log.level)

    def _update_status(self) -> None:
        state = self.state()
        if state == "draining":
            self.notifier.status(f"draining: {self.inflight_count()} in flight")
        elif state == "serving":
            counts = ", ".join(f"{route} {n}" for route, n in sorted(self.route_stats.routes.items())) or "none yet"
            self.notifier.status(f"serving: {self.inflight_count()} in flight; requests: {counts}")
        else:
            self.notifier.status(f"{state}: decoder {self.decoder.state.value}")

    # -- the tree ----------------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self, *, task_status: trio.TaskStatus[Started] = trio.TASK_STATUS_IGNORED) -> None:
        lock = lock_runtime_dir(self.runtime_dir)
        try:
            # Bound before anything that takes time starts: a port in use stops onebitd with one
            # line naming the key, and no child is started for nothing.
            self.front.bind()
        except BaseException:
            (self.runtime_dir / LOCK_NAME).unlink(missing_ok=True)  # ours while we hold it
            os.close(lock)
            raise
        prepare_runtime_dir(self.runtime_dir)
        self._started_clock = trio.current_time()
        clean = False
        try:
            await self._choose_layout()
            async with self._open_store() as store, trio.open_nursery() as nursery:
                await nursery.start(self.decoder.run)
                for provider in self.providers.all:
                    await nursery.start(provider.run)
                self.store = store
                stored = StoredPrefixes(client=self.client, state_dir=self.state_dir, store=store)
                await nursery.start(self.completions.run, stored)
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
            if self.hybrid is not None:
                # Every provider is stopped: what one wrote for a job we gave up on goes now.
                self.hybrid.file.sweep()
            with trio.CancelScope(shield=True):
                await self.client.aclose()
            if clean:
                self._remove_own_files()
            os.close(lock)
            log.info("stopped")

    def _remove_own_files(self) -> None:
        """A clean stop leaves the runtime directory as it found it: the children's sockets (they
        are stopped and reaped; llama-server leaves its socket file behind) and our lock go, and
        nothing else in the directory is touched.  The admin socket removes itself."""
        sockets = [self.client.socket]
        sockets += [p.launcher.socket for p in self.providers.all if isinstance(p, LlamaServerProvider)]
        for path in [*sockets, self.runtime_dir / LOCK_NAME]:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)

    def _llama_providers(self) -> list[LlamaServerProvider]:
        return [p for p in self.providers.all if isinstance(p, LlamaServerProvider)]

    async def _choose_layout(self) -> None:
        """Before any child starts: each OpenVINO provider's device (its runtime's list), then one KV
        layout for every llama-server child.  A provider on the static path (an NPU) writes files with
        one KV stream, which only a unified-KV decoder restores (supervisor/openvino.py)."""
        for provider in self._llama_providers():
            if provider.engine == "openvino" and provider.device is None:
                await provider.choose_device()
        self.kv_unified = any(p.static for p in self._llama_providers() if p.refused is None)
        if self.kv_unified:
            log.info("a provider takes the static path: every llama-server runs with %s", " ".join(UNIFIED_ARGS))
        self.launcher.kv_unified = self.kv_unified
        for provider in self._llama_providers():
            provider.launcher.kv_unified = self.kv_unified

    @asynccontextmanager
    async def _open_store(self) -> AsyncIterator[PrefixStore]:
        """The prefix store ``[cache]`` describes; off (one log line) when it cannot work."""
        if not self.config.cache.enabled:
            yield PrefixStore.disabled("cache.enabled is false", level=logging.INFO)
            return
        binary = locate.llama_server(self.config.decoder.binary)
        try:
            if binary is None:
                raise ChildError("no llama-server binary")
            version = await server_version(binary)
        except ChildError as exc:
            yield PrefixStore.disabled(f"cannot tell the decoder's version: {exc}")
            return
        engines = [p.describe for p in self._llama_providers()]
        async with open_prefix_store(self.config, version, kv_unified=self.kv_unified, engines=engines) as store:
            yield store

    async def _drain_for_stop(self) -> None:
        """SIGTERM is a drain with server.shutdown_grace_s, then the stop."""
        self.notifier.stopping()
        self.start_drain()
        self.stopping = True
        log.info(
            "stopping: %d request(s) in flight, up to %gs", self.inflight_count(), self.config.server.shutdown_grace_s
        )
        with trio.move_on_after(self.config.server.shutdown_grace_s):
            await self.front.wait_idle()
        if self.inflight_count():
            log.warning("stopping with %d request(s) still in flight after the grace period", self.inflight_count())

    async def _announce(self) -> None:
        """READY=1 once the front is bound, every provider's first start is over (healthy or failed:
        requests routed before would quietly go plain) and the decoder is healthy; then STATUS= and
        the watchdog."""
        for provider in self.providers.all:
            await provider.wait_settled()
        self._providers_settled = True
        await self.decoder.wait_state(ChildState.READY)
        not_ready = [p for p in self.providers.all if not p.ready]
        for provider in not_ready:
            if provider.statistics().refused is not None:
                continue  # its refusal was logged, one line, with why
            why = provider.child.statistics().last_exit if provider.child is not None else None
            log.error(
                "provider %s is not ready (%s): requests take the plain route until it is",
                provider.name,
                why or "its start failed",
            )
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
                    lambda: self.decoder.state in (ChildState.STARTING, ChildState.READY),
                )
            while True:
                await trio.sleep(STATUS_INTERVAL_S)
                self._update_status()


async def _serve(config: Config, config_path: str) -> None:
    notifier = Notifier()
    daemon = Daemon(config, config_path=config_path, notifier=notifier)
    async with trio.open_nursery() as nursery:

        async def on_signals() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
                async for signum in signals:
                    log.info("received %s", signal.Signals(signum).name)
                    if signum == signal.SIGHUP:
                        with contextlib.suppress(ConfigError):  # Daemon.reload logged why
                            daemon.reload()
                    else:
                        daemon.request_stop()

        nursery.start_soon(on_signals)
        try:
            await daemon.run()
        finally:
            nursery.cancel_scope.cancel()
            notifier.close()


def local_url(config: Config) -> str:
    """Where a client on this machine reaches the first address of ``server.host`` on
    ``server.port`` (scripts/run's banner): a wildcard bind answers on loopback too."""
    host = config.server.host[0].strip("[]")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{config.server.port}" if ":" in host else f"http://{host}:{config.server.port}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onebitd", description="onebit supervisor daemon")
    parser.add_argument("--config", default=os.environ.get("ONEBIT_CONFIG", DEFAULT_CONFIG), help="TOML file")
    parser.add_argument("--check-config", metavar="FILE", help="check FILE and exit (0: good)")
    parser.add_argument("--log-format", choices=("logfmt", "json"), help="overrides log.format")
    parser.add_argument("--version", action="version", version=f"onebitd {__version__}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    path = args.check_config or args.config
    try:
        config = configuration.load(path)
    except ConfigError as exc:
        for line in exc.lines:
            print(f"onebitd: {line}", file=sys.stderr)
        return 2
    if args.check_config:
        print(f"{path}: ok")
        return 0
    logs.setup(args.log_format or config.log.format, config.log.level)
    status = 0
    try:
        trio.run(_serve, config, path)
    except* (ChildError, RuntimeDirInUse, ListenError) as group:
        # The one place start-up errors are printed: each one line, however deep in the nurseries'
        # exception groups it was raised.  Those that name a config key name the file too.
        for refused in leaves(group):
            where = f"{path}: " if isinstance(refused, RuntimeDirInUse | ListenError) else ""
            print(f"onebitd: {where}{refused}", file=sys.stderr)
        status = 1
    return status


def leaves(error: BaseException) -> list[BaseException]:
    """The exceptions an exception group holds, at any depth; an exception that is none, itself."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for sub in error.exceptions for leaf in leaves(sub)]
    return [error]


if __name__ == "__main__":
    sys.exit(main())
