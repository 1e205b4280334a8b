"""How a llama-server child is started: its command line, derived from the one [model] section.

Decoder and llama-server providers share ``-m``, ``-c``, ``-np``, batch sizes and cache types (a slot
state file saved under other parameters is refused by the decoder's restore); only threads, CPU
affinity and extra arguments differ per child.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from . import locate
from .config import Config, ModelConfig
from .decoder import DecoderClient
from .errors import ChildError


def model_args(model: ModelConfig, model_path: Path) -> list[str]:
    return [
        "-m", str(model_path),
        "-c", str(model.ctx_size),
        "-np", str(model.parallel),
        "-b", str(model.batch_size),
        "-ub", str(model.ubatch_size),
        "-ctk", model.cache_type_k,
        "-ctv", model.cache_type_v,
    ]  # fmt: skip


def model_alias(config: Config) -> str:
    if config.model.alias:
        return config.model.alias
    path = locate.model_path(config.model.path)
    return path.stem if path is not None else "model"


def connection_limit(parallel: int) -> int:
    """Connections to one llama-server: a stream and a slot action per slot at once, with room to spare."""
    return 4 * parallel + 8


class LlamaServerLauncher:
    """A :class:`~supervisor.child.Launcher` for one llama-server listening on ``client.socket``.

    The client is the caller's (the daemon builds the decoder's once and hands it out); the launcher
    health-checks through it."""

    def __init__(
        self,
        name: str,
        config: Config,
        *,
        binary: str,
        client: DecoderClient,
        slot_save_path: Path,
        threads: int,
        extra_args: Sequence[str],
    ) -> None:
        self.name = name
        self.client = client
        self.socket = socket = client.socket
        self.slot_save_path = slot_save_path
        path = locate.llama_server(binary)
        model = locate.model_path(config.model.path)
        if path is None or model is None:
            raise ChildError(f"{name}: no llama-server binary or model file (config.check() vets both)")
        self._argv = [
            str(path),
            *model_args(config.model, model),
            "--host", str(socket),  # a host ending in .sock makes llama-server listen on a unix socket
            "--slot-save-path", str(slot_save_path),
            "--alias", model_alias(config),
            "--no-webui",
            # llama-server's Prometheus metrics: onebitd appends them to its own /metrics and
            # relays them at /metrics/decoder.  Counting costs nothing measurable; exposing is opt-in.
            "--metrics",
        ]  # fmt: skip
        if threads:
            self._argv += ["-t", str(threads)]
        self._argv += list(extra_args)

    def argv(self) -> Sequence[str]:
        return self._argv

    def prepare(self) -> None:
        # A socket file left by a killed child makes the next bind fail with EADDRINUSE.
        self.socket.unlink(missing_ok=True)
        self.slot_save_path.mkdir(parents=True, exist_ok=True)

    async def healthy(self) -> bool:
        return await self.client.healthy()
