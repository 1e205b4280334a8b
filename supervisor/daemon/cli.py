"""onebitd's command line: read and check the config, run the daemon under ``trio.run`` with its
signals (SIGTERM/SIGINT: stop accepting, finish in-flight, stop children; SIGHUP: reload), and
print start-up errors one line each.

    onebitd [--config FILE] [--log-format logfmt|json]
    onebitd --check-config FILE          "FILE: ok" and exit 0, or its error lines and exit 2

Exit status: 0 stopped cleanly; 1 a start-up error (a child, the runtime directory, a port);
2 a config error.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence

import trio

from .. import __version__
from .. import config as configuration
from ..config import Config, locate
from ..config.checks import model_keys
from ..errors import ChildError, ConfigError, ListenError, RuntimeDirInUse
from ..llama import gguf
from ..observe import logs
from ..supervise.notify import Notifier
from .root import Daemon

log = logging.getLogger("onebit.daemon")


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
    parser.add_argument("--config", default=locate.config_file(), help="TOML file")
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
    broken = model_file_problems(config, path)
    for line in broken:
        print(f"onebitd: {line}", file=sys.stderr)
    if broken:
        return 2
    if args.check_config:
        print(f"{path}: ok")
        return 0
    logs.setup(args.log_format or config.log.format, config.log.level, children=config.log.children)
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


def model_file_problems(config: Config, source: str) -> list[str]:
    """One line for each model file whose GGUF header says llama.cpp cannot load it (not a GGUF, a
    truncated file), naming the config file, the key and the model file: caught before anything
    starts, where a decoder would only fail its load."""
    lines: list[str] = []
    for key, table in model_keys(config):
        model = locate.model_path(table.path)
        if model is None or not locate.is_file(model):
            continue  # the config's own check said so
        problem = gguf.file_problem(model)
        if problem is not None:
            lines.append(f"{source}: {key}.path: {model}: {problem}")
    return lines


def leaves(error: BaseException) -> list[BaseException]:
    """The exceptions an exception group holds, at any depth; an exception that is none, itself."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for sub in error.exceptions for leaf in leaves(sub)]
    return [error]
