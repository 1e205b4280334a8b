"""onebitd: the root of the supervision tree.

    onebitd (trio.run)
    └── Daemon.run ─ nursery
        ├── Child(decoder).run      llama-server on <runtime>/decoder.sock: spawn, health-gate, restart
        ├── Front.run               hypercorn on server.host:port; one cancel scope per request
        └── signals                 SIGTERM/SIGINT: stop accepting, finish in-flight, stop children

Start order: the decoder is spawned first (so it loads while we bind), then the front binds, then
``task_status.started`` reports the bound addresses.  Shutdown is the reverse: the front stops
accepting and waits for in-flight requests up to ``server.shutdown_grace_s``, then the nursery is
cancelled and every child is stopped and reaped under a shielded scope.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs
import trio

from . import __version__, locate, logs
from . import config as configuration
from .child import Child
from .completion import Completions, HybridSettings
from .config import Config, ProviderConfig
from .config import ExecProvider as ExecProviderConfig
from .config import LlamaServerProvider as LlamaServerProviderConfig
from .errors import ConfigError
from .front import Front
from .handoff import FileHandoff
from .llama_server import LlamaServerLauncher, model_alias
from .provider import Provider, Providers
from .provider_exec import ExecProvider
from .provider_llama import LlamaServerProvider
from .provider_worker import WorkerProvider
from .share import ShareHandoff, ShareHandshake
from .slots import SlotPool

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


def prepare_runtime_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    # Whatever a crashed daemon left here (sockets, state files) belongs to no live request.
    state = path / "state"
    if state.is_dir():
        for leftover in state.iterdir():
            if leftover.is_file():
                leftover.unlink(missing_ok=True)


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.runtime_dir = locate.runtime_dir(config.server.runtime_dir)
        self.launcher = LlamaServerLauncher(
            "decoder",
            config,
            binary=config.decoder.binary,
            socket=self.runtime_dir / "decoder.sock",
            slot_save_path=self.runtime_dir / "state",
            threads=config.decoder.threads,
            extra_args=config.decoder.extra_args,
        )
        self.decoder = Child(
            self.launcher,
            config.decoder.health,
            config.decoder.restart,
            cpu_affinity=config.decoder.cpu_affinity,
        )
        self.slots = SlotPool(config.model.parallel, config.server.queue_limit)
        self.state_dir = self.runtime_dir / "state"
        self.providers = Providers([self._provider(spec) for spec in config.provider])
        hybrid = None
        if config.hybrid.enabled and self.providers.all:
            hybrid = HybridSettings(
                providers=self.providers,
                handoff=FileHandoff(
                    client=self.launcher.client,
                    state_dir=self.state_dir,
                    model=model_alias(config),
                    n_ctx=config.model.ctx_size,
                    prefill_timeout_s=config.hybrid.prefill_timeout_s,
                ),
                min_prompt_tokens=config.hybrid.min_prompt_tokens,
                restore_check_tokens=config.hybrid.restore_check_tokens,
                share=self._share_handoff() if share_enabled(config) else None,
            )
        self.completions = Completions(
            decoder=self.decoder, client=self.launcher.client, slots=self.slots, hybrid=hybrid
        )
        self.front = Front(
            config.server, decoder=self.decoder, client=self.launcher.client, completions=self.completions
        )
        self._stop = trio.Event()

    def _share_handoff(self) -> ShareHandoff:
        return ShareHandoff(
            client=self.launcher.client,
            handshake=ShareHandshake(
                client=self.launcher.client,
                runtime_dir=self.runtime_dir,
                connect_timeout_s=SHARE_CONNECT_TIMEOUT_S,
            ),
            model=model_alias(self.config),
            n_ctx=self.config.model.ctx_size,
            prefill_timeout_s=self.config.hybrid.prefill_timeout_s,
        )

    def _provider(self, spec: ProviderConfig) -> Provider:
        if isinstance(spec, LlamaServerProviderConfig):
            return LlamaServerProvider(spec, self.config, runtime_dir=self.runtime_dir, state_dir=self.state_dir)
        if isinstance(spec, ExecProviderConfig):
            return ExecProvider(spec)
        return WorkerProvider(spec)

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self, *, task_status: trio.TaskStatus[Started] = trio.TASK_STATUS_IGNORED) -> None:
        prepare_runtime_dir(self.runtime_dir)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.decoder.run)
                for provider in self.providers.all:
                    await nursery.start(provider.run)
                async with trio.open_nursery() as front_nursery:
                    binds: list[str] = await front_nursery.start(self.front.run)
                    log.info("onebitd %s listening on %s", __version__, ", ".join(binds))
                    task_status.started(Started(binds, self.runtime_dir))
                    await self._stop.wait()
                    log.info("stopping: %d request(s) in flight", len(self.front.inflight))
                    self.front.draining = True
                    self.front.stop()
                # The front returned: in-flight requests are done (or past the grace period).
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self.launcher.client.aclose()
            log.info("stopped")


async def _serve(config: Config) -> None:
    daemon = Daemon(config)
    async with trio.open_nursery() as nursery:

        async def on_signals() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("received %s", signal.Signals(signum).name)
                    daemon.request_stop()

        nursery.start_soon(on_signals)
        await nursery.start(daemon.run)
        await daemon._stop.wait()
        # daemon.run returns once it has drained and stopped its children.
    return None


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
    trio.run(_serve, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
