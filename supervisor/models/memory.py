"""What a model takes of the machine's memory: estimated before it loads (its GGUF file and KV caches)
and measured while it is loaded (its processes' resident memory)."""

from __future__ import annotations

import os

import attrs

from ..config import locate
from ..config.modelspec import ModelSpec
from ..config.schema import LlamaServerProviderConfig, ModelConfig
from ..llama import gguf

MIB = 1024 * 1024


@attrs.frozen
class ModelFile:
    """A model's GGUF file as a load reads it, once: its size and its header's shape (None: a header
    this reader does not know).  Every estimate and layout choice of the load takes this one read."""

    size: int
    shape: gguf.Shape | None

    @property
    def sliding_window(self) -> int | None:
        """The model's sliding window; None without one or with an unknown header."""
        return self.shape.sliding_window if self.shape is not None else None


def read_model(spec: ModelSpec) -> ModelFile | None:
    """The model's file, read once; None when it is not there or cannot be read (a broken file is
    the start's to report: supervisor/daemon/cli.py's model_file_problems)."""
    path = locate.model_path(spec.table.path)
    if path is None:
        return None
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            shape = gguf.read_shape(file)
    except OSError:
        return None
    except gguf.NotGguf:
        return ModelFile(size, None)
    return ModelFile(size, shape)


def estimate_mib(spec: ModelSpec, found: ModelFile | None, *, swa_full: bool = False) -> float:
    """What the model takes loaded, before its processes' memory is measured (:func:`footprint_mib`):
    its GGUF file ``found`` (:func:`read_model`), and for its decoder and each of its llama-server
    providers its caches (:func:`cache_bytes`, from the GGUF's header) and ``--cache-ram``.  0 when the
    file cannot be read; a header this reader does not know counts no cache.  Pure."""
    if found is None:
        return 0.0
    processes = 1 + sum(isinstance(p, LlamaServerProviderConfig) for p in spec.config.provider)
    kv = cache_bytes(found.shape, spec.table, swa_full=swa_full) if found.shape is not None else 0.0
    return footprint_mib(found.size, kv, processes=processes, cache_ram_mib=spec.config.cache.ram_mib)


def cache_bytes(shape: gguf.Shape, table: ModelConfig, *, swa_full: bool) -> float:
    """One llama-server's caches for ``table``, as llama.cpp sizes them: its context, capped at the
    training context a slot, in each full-attention layer; in each sliding-window layer (unless
    ``--swa-full``) only the window per slot and one micro-batch; and each slot's recurrent state.
    Pure."""
    slots = max(table.parallel, 1)
    ctx = table.ctx_size
    if shape.context_length is not None:
        ctx = min(ctx, shape.context_length * slots)
    per_layer = shape.kv_bytes_per_token(table.cache_type_k, table.cache_type_v) / max(shape.attention_layers, 1)
    swa = min(shape.swa_layers, shape.attention_layers)
    full = shape.attention_layers - swa
    window = (
        ctx if swa_full or shape.sliding_window is None else min(ctx, shape.sliding_window * slots + table.ubatch_size)
    )
    return per_layer * (full * ctx + swa * window) + shape.recurrent_bytes() * slots


def footprint_mib(file_bytes: int, kv_bytes: float, *, processes: int, cache_ram_mib: int) -> float:
    """The weights once (every llama-server of a model maps the one file, which the page cache holds
    once), and per process its KV cache and its prompt cache's bound (``cache.ram_mib``, its
    ``--cache-ram``; -1, unbounded, counts nothing, as 0).  Pure."""
    per_process = kv_bytes + max(cache_ram_mib, 0) * MIB
    return (file_bytes + processes * per_process) / MIB


def rss_mib(pid: int | None) -> float | None:
    """A process's resident memory (Linux's /proc), or None."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / (1024 * 1024)
