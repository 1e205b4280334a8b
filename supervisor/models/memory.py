"""What a model takes of the machine's memory: estimated before it loads (its GGUF file and KV caches)
and measured while it is loaded (its processes' resident memory)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

import attrs

from ..config import locate
from ..config.modelspec import ModelSpec
from ..config.schema import LlamaServerProviderConfig, ModelConfig
from ..llama import gguf

MIB = 1024 * 1024
# llama-server's context checkpoints a slot (``--ctx-checkpoints``; common/common.h's
# ``n_ctx_checkpoints`` in the build scripts/build-llama-server makes).  onebit passes no value of
# its own, so this one holds unless decoder.extra_args or the model's extra_args give one.
CTX_CHECKPOINTS = 32
_CTX_CHECKPOINTS_FLAGS = ("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints")


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
    providers its caches (:func:`cache_bytes`, from the GGUF's header), its context checkpoints
    (:func:`checkpoint_bytes`, as many as the decoder's flags keep) and ``--cache-ram``.  0 when the
    file cannot be read; a header this reader does not know counts no cache.  Pure."""
    if found is None:
        return 0.0
    processes = 1 + sum(isinstance(p, LlamaServerProviderConfig) for p in spec.config.provider)
    kv = 0.0
    if found.shape is not None:
        checkpoints = ctx_checkpoints([*spec.config.decoder.extra_args, *spec.table.extra_args])
        kv = cache_bytes(found.shape, spec.table, swa_full=swa_full)
        kv += checkpoint_bytes(found.shape, spec.table, swa_full=swa_full, checkpoints=checkpoints)
    return footprint_mib(found.size, kv, processes=processes, cache_ram_mib=spec.config.cache.ram_mib)


def cache_bytes(shape: gguf.Shape, table: ModelConfig, *, swa_full: bool) -> float:
    """One llama-server's caches for ``table``: its attention layers' KV (:func:`kv_cache_bytes`)
    and each slot's recurrent or convolution state (:func:`recurrent_cache_bytes`).  Pure."""
    return kv_cache_bytes(shape, table, swa_full=swa_full) + recurrent_cache_bytes(shape, table)


def _cells(n: int) -> int:
    """llama.cpp pads a cache's cells to a multiple of 256 (llama-context.cpp, llama-kv-cache-iswa.cpp)."""
    return -(-n // 256) * 256


@attrs.frozen
class _SlotKv:
    """One slot's KV cache: its cells in a full-attention layer and in a sliding-window one, and one
    cell's K and V in one layer, in bytes."""

    per_slot: int
    window: int
    per_layer: float


def _slot_kv(shape: gguf.Shape, table: ModelConfig, *, swa_full: bool) -> _SlotKv:
    per_slot = _cells(_cells(table.ctx_size) // max(table.parallel, 1))
    if shape.context_length is not None:
        per_slot = min(per_slot, _cells(shape.context_length))
    window = per_slot
    if not swa_full and shape.sliding_window is not None:
        window = _cells(min(per_slot, shape.sliding_window + table.ubatch_size))
    per_layer = shape.kv_bytes_per_token(table.cache_type_k, table.cache_type_v) / max(shape.attention_layers, 1)
    return _SlotKv(per_slot, window, per_layer)


def kv_cache_bytes(shape: gguf.Shape, table: ModelConfig, *, swa_full: bool) -> float:
    """The KV cache of one llama-server for ``table``, as llama.cpp sizes it (a stream a slot, its
    default): a slot's context (``ctx_size / parallel``, capped at the training context, padded to
    256 cells) in each full-attention layer; in each sliding-window layer (unless ``--swa-full``)
    the window and one micro-batch a slot, padded to 256 cells.  Recurrent and convolution layers
    keep no KV.  Pure."""
    slot = _slot_kv(shape, table, swa_full=swa_full)
    swa = min(shape.swa_layers, shape.attention_layers)
    full = shape.attention_layers - swa
    return slot.per_layer * max(table.parallel, 1) * (full * slot.per_slot + swa * slot.window)


def recurrent_cache_bytes(shape: gguf.Shape, table: ModelConfig) -> float:
    """The recurrent or convolution state of one llama-server for ``table``: one sequence's
    (:meth:`~supervisor.llama.gguf.Shape.recurrent_bytes`) a slot, as llama.cpp's
    ``llama_memory_recurrent`` keeps a cell a sequence.  0 for a model without one.  Pure."""
    return shape.recurrent_bytes() * max(table.parallel, 1)


def checkpoint_bytes(shape: gguf.Shape, table: ModelConfig, *, swa_full: bool, checkpoints: int) -> float:
    """One llama-server's context checkpoints for ``table``, every slot's full: llama-server keeps
    up to ``checkpoints`` a slot (tools/server/server-context.cpp's ``create_checkpoint``), each a
    copy of the part of the slot's memory that cannot be cut back to an earlier token
    (``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``): its recurrent or convolution state and its
    sliding-window layers' cells (the window's, as measured: tests/real/test_real_memory.py; the
    slot's context under ``--swa-full``).  It takes them for a hybrid model, and for a
    sliding-window one without ``--swa-full``; none for an attention-only model whose cells all
    stay.  Pure."""
    slides = shape.sliding_window is not None and not swa_full
    if not (shape.hybrid or slides):
        return 0.0
    slot = _slot_kv(shape, table, swa_full=swa_full)
    swa, cells = 0, 0
    if shape.sliding_window is not None:
        swa = min(shape.swa_layers, shape.attention_layers)
        cells = slot.per_slot if swa_full else min(slot.per_slot, shape.sliding_window)
    one = shape.recurrent_bytes() + swa * cells * slot.per_layer
    return one * max(checkpoints, 0) * max(table.parallel, 1)


def ctx_checkpoints(args: Sequence[str]) -> int:
    """The ``--ctx-checkpoints`` of a llama-server given ``args`` after onebit's own flags: the
    last value given (llama-server takes an option's last occurrence), else CTX_CHECKPOINTS."""
    found = CTX_CHECKPOINTS
    for flag, value in itertools.pairwise(args):
        if flag in _CTX_CHECKPOINTS_FLAGS and value.lstrip("-").isdigit():
            found = int(value)
    return found


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
