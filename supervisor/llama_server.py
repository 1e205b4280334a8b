"""How a llama-server child is started: its command line, derived from the one [model] section.

Decoder and llama-server providers share ``-m``, ``-c``, ``-np``, batch sizes and cache types (a slot
state file saved under other parameters is refused by the decoder's restore); only threads, CPU
affinity and extra arguments differ per child.

The decoder of the share route runs with ``LLAMA_KV_SHARE=1`` (the patched llama-server then keeps its
KV cache on memfd regions it can lend); every other llama-server runs without it, whatever onebitd's
own environment holds, so stock behaviour never depends on it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from . import locate
from .config import Config, ModelConfig
from .decoder import DecoderClient
from .errors import ChildError

# The patched llama-server's switch (scripts/llama-server-share.patch): its KV cache on memfd regions.
KV_SHARE_ENV = "LLAMA_KV_SHARE"


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
    path = locate.model_path(config)
    return path.stem if path is not None else "model"


class LlamaServerLauncher:
    """A :class:`~supervisor.child.Launcher` for one llama-server listening on a unix socket."""

    def __init__(
        self,
        name: str,
        config: Config,
        *,
        binary: str,
        socket: Path,
        slot_save_path: Path,
        threads: int,
        extra_args: Sequence[str],
        kv_share: bool = False,
    ) -> None:
        self.name = name
        self.kv_share = kv_share
        self.socket = socket
        self.slot_save_path = slot_save_path
        path = locate.llama_server(binary)
        model = locate.model_path(config)
        if path is None or model is None:
            raise ChildError(f"{name}: no llama-server binary or model file (config.check() vets both)")
        self._argv = [
            str(path),
            *model_args(config.model, model),
            "--host", str(socket),  # a host ending in .sock makes llama-server listen on a unix socket
            "--slot-save-path", str(slot_save_path),
            "--alias", model_alias(config),
            "--no-webui",
        ]  # fmt: skip
        if threads:
            self._argv += ["-t", str(threads)]
        self._argv += list(extra_args)
        self.client = DecoderClient(socket, max_connections=4 * config.model.parallel + 8)

    def argv(self) -> Sequence[str]:
        return self._argv

    @property
    def env(self) -> Mapping[str, str] | None:
        """Read at every spawn: onebitd's environment, with ``LLAMA_KV_SHARE`` only for a sharing decoder."""
        if not self.kv_share and KV_SHARE_ENV not in os.environ:
            return None  # inherit unchanged
        env = {key: value for key, value in os.environ.items() if key != KV_SHARE_ENV}
        if self.kv_share:
            env[KV_SHARE_ENV] = "1"
        return env

    def prepare(self) -> None:
        # A socket file left by a killed child makes the next bind fail with EADDRINUSE.
        self.socket.unlink(missing_ok=True)
        self.slot_save_path.mkdir(parents=True, exist_ok=True)

    async def healthy(self) -> bool:
        return await self.client.healthy()
