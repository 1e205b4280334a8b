"""How a llama-server child is started: its command line, derived from the one [model] section.

Decoder and llama-server providers share ``-m``, ``-c``, ``-np``, batch sizes and cache types (a slot
state file saved under other parameters is refused by the decoder's restore); only threads, CPU
affinity and extra arguments differ per child.

The decoder of the share route runs with ``LLAMA_KV_SHARE=1`` (the patched llama-server then keeps its
KV cache on memfd regions it can lend); every other llama-server runs without it, whatever onebitd's
own environment holds, so stock behaviour never depends on it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ..config import Config, ModelConfig, locate
from ..errors import ChildError
from ..supervise.process import output_of
from .decoder import DecoderClient
from .openvino import UNIFIED_ARGS

# How llama-server says that it cannot load the model file (llama.cpp's llama_model_load).
_LOAD_ERROR = "error loading model:"

# The patched llama-server's switch (patches/llama-server-share.patch): its KV cache on memfd regions.
KV_SHARE_ENV = "LLAMA_KV_SHARE"


def model_args(model: ModelConfig, model_path: Path, *, parallel: int | None = None) -> list[str]:
    """``parallel``: the slots of a child that cannot run [model]'s (a static-shape provider: 1)."""
    return [
        "-m", str(model_path),
        "-c", str(model.ctx_size),
        "-np", str(model.parallel if parallel is None else parallel),
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
    """A :class:`~supervisor.supervise.child.Launcher` for one llama-server listening on ``client.socket``.

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
        kv_share: bool = False,
        kv_unified: bool = False,
        swa_full: bool = False,
        binary_path: Path | None = None,
    ) -> None:
        """``kv_unified``: the daemon's one KV layout (supervisor/llama/openvino.py's UNIFIED_ARGS), the same
        for every llama-server child; ``swa_full``: the model's sliding-window layers keep every
        cell (supervisor/models/layout.py), the same for every child of the model; ``binary_path``:
        a binary found by another lookup than ``binary``'s (an OpenVINO build)."""
        self.name = name
        self.kv_share = kv_share
        self.client = client
        self.socket = socket = client.socket
        self.slot_save_path = slot_save_path
        path = binary_path or locate.llama_server(binary)
        model = locate.model_path(config.model.path)
        if path is None or model is None:
            raise ChildError(f"{name}: no llama-server binary or model file (config.check() vets both)")
        self.binary = path
        self._model = (config.model, model)
        # Set by a provider once it knows its device, before its first spawn: the engine's
        # variables, and its slots where they are not [model]'s.
        self.engine_env: Mapping[str, str] = {}
        self.parallel: int | None = None
        self._rest = [
            "--host", str(socket),  # a host ending in .sock makes llama-server listen on a unix socket
            "--slot-save-path", str(slot_save_path),
            "--alias", model_alias(config),
            "--no-webui",
            # An explicit bound on llama-server's in-memory prompt cache (see CacheConfig.ram_mib);
            # extra_args come later, and llama-server's last occurrence of an option wins.
            "--cache-ram", str(config.cache.ram_mib),
            # llama-server's Prometheus metrics: onebitd appends them to its own /metrics and
            # relays them at /metrics/decoder.  Counting costs nothing measurable; exposing is opt-in.
            "--metrics",
        ]  # fmt: skip
        # The daemon's layout, set once it has asked its OpenVINO providers for their devices and
        # before any child starts.
        self.kv_unified = kv_unified
        self.swa_full = swa_full
        if threads:
            self._rest += ["-t", str(threads)]
        self._rest += list(extra_args)

    def argv(self) -> Sequence[str]:
        model, path = self._model
        unified = list(UNIFIED_ARGS) if self.kv_unified else []
        if self.swa_full:
            unified.append("--swa-full")
        return [str(self.binary), *model_args(model, path, parallel=self.parallel), *unified, *self._rest]

    @property
    def env(self) -> Mapping[str, str] | None:
        """Read at every spawn: onebitd's environment, with ``LLAMA_KV_SHARE`` only for a sharing
        decoder, and an OpenVINO provider's variables."""
        if not self.kv_share and KV_SHARE_ENV not in os.environ and not self.engine_env:
            return None  # inherit unchanged
        env = {key: value for key, value in os.environ.items() if key != KV_SHARE_ENV}
        if self.kv_share:
            env[KV_SHARE_ENV] = "1"
        env.update(self.engine_env)
        return env

    pass_fds: Sequence[int] = ()  # llama-server inherits nothing but its standard streams

    def spawned(self) -> None:
        return

    def fatal(self, line: str) -> str | None:
        """llama-server's ``llama_model_load: error loading model: WHY`` (a file that is no GGUF, is
        truncated, or of an architecture this llama.cpp lacks): every start would end so."""
        _, marker, why = line.partition(_LOAD_ERROR)
        if not marker:
            return None
        model = self._model[1]
        return f"model.path {model}: llama-server cannot load it: {why.strip()}"

    def prepare(self) -> None:
        # A socket file left by a killed child makes the next bind fail with EADDRINUSE.
        self.socket.unlink(missing_ok=True)
        self.slot_save_path.mkdir(parents=True, exist_ok=True)

    async def healthy(self) -> bool:
        return await self.client.healthy()


async def server_version(binary: Path, *, timeout_s: float = 30.0) -> str:
    """What ``llama-server --version`` says (``version: 11434 (abc1234)``, the build line after it).

    Raises :class:`~supervisor.errors.ChildError` when it cannot be run or says nothing in time.
    """
    lines, returncode = await output_of("llama-server --version", [str(binary), "--version"], timeout_s=timeout_s)
    said = [line.strip() for line in lines if line.strip()]
    version = [line for line in said if line.startswith("version:")]
    if returncode != 0 or not said:
        raise ChildError(f"{binary} --version: {returncode}, said {' | '.join(said)[:200]!r}")
    return " | ".join(version + [line for line in said if line.startswith("built with")]) or said[0]


# Enough of a GGUF to tell two files apart that share a size and an mtime: the header, its metadata
# and the start of the tensor data.
_MODEL_HEAD_BYTES = 1024 * 1024


@attrs.frozen
class StateFingerprint:
    """What a state file's usability depends on.  An entry made under another fingerprint is dropped.

    The model file is identified by path, size, mtime and its first MiB; ``server_version`` is what
    ``llama-server --version`` says (:func:`server_version`).  The decoder's
    ``extra_args`` are in because some of them change the KV cache's layout (``-fa``, ``--swa-full``).
    """

    model_path: str
    model_size: int
    model_mtime_ns: int
    model_head_sha256: str
    server_version: str
    ctx_size: int
    parallel: int
    batch_size: int
    ubatch_size: int
    cache_type_k: str
    cache_type_v: str
    extra_args: tuple[str, ...]
    # The KV layout every llama-server child runs with (supervisor/llama/openvino.py's UNIFIED_ARGS), and
    # what each llama-server provider computes on, ``name=engine/device`` (``/static`` on the static
    # path).  A slot saved after a handed-over prompt holds the provider's KV, which another engine
    # or device computes differently.  Both are left out of the sidecar where they say nothing new
    # (no unified layout; every provider the decoder's own engine), so a store made before they
    # existed stays valid.
    kv_unified: bool = False
    engines: tuple[str, ...] = ()
    # Whether the children keep the sliding-window layers' every cell (--swa-full): a state saved
    # without it holds only the window.  Left out of the sidecar when off.
    swa_full: bool = False

    @classmethod
    def of(
        cls,
        config: Config,
        server_version: str,
        *,
        kv_unified: bool = False,
        engines: Sequence[str] = (),
        swa_full: bool = False,
    ) -> StateFingerprint:
        """The running decoder's fingerprint (``kv_unified`` and ``engines``: what the daemon resolved
        at start).  Reads the model file: raises OSError."""
        path = locate.model_path(config.model.path)
        if path is None:
            raise FileNotFoundError("no model file (config.check() vets it)")
        stat = path.stat()
        with open(path, "rb") as model:
            head = hashlib.sha256(model.read(_MODEL_HEAD_BYTES)).hexdigest()
        m = config.model
        return cls(
            model_path=str(path.absolute()),
            model_size=stat.st_size,
            model_mtime_ns=stat.st_mtime_ns,
            model_head_sha256=head,
            server_version=server_version,
            ctx_size=m.ctx_size,
            parallel=m.parallel,
            batch_size=m.batch_size,
            ubatch_size=m.ubatch_size,
            cache_type_k=m.cache_type_k,
            cache_type_v=m.cache_type_v,
            extra_args=tuple(config.decoder.extra_args),
            kv_unified=kv_unified,
            engines=tuple(engines),
            swa_full=swa_full,
        )

    def as_json(self) -> dict[str, Any]:
        """As the sidecar holds it (tuples become lists), for comparing with what a sidecar says."""
        document: dict[str, Any] = json.loads(json.dumps(attrs.asdict(self)))
        if not self.kv_unified:
            del document["kv_unified"]
        if not self.swa_full:
            del document["swa_full"]
        if all("=ggml/" in engine for engine in self.engines):
            del document["engines"]
        return document
