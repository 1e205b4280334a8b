"""What a model takes of the machine's memory: estimated before it loads (its GGUF file and KV caches)
and measured while it is loaded (its processes' resident memory)."""

from __future__ import annotations

import os

from ..config import locate
from ..config.modelspec import ModelSpec
from ..config.schema import LlamaServerProvider
from ..llama import gguf

MIB = 1024 * 1024


def estimate_mib(spec: ModelSpec) -> float:
    """What the model takes loaded, before its processes' memory is measured (:func:`footprint_mib`):
    the GGUF file, and for its decoder and each of its llama-server providers a KV cache for
    ``ctx_size`` (from the GGUF's header) and ``--cache-ram``.  0 when the file cannot be read; a
    header this reader does not know counts no KV."""
    path = locate.model_path(spec.table.path)
    if path is None:
        return 0.0
    table = spec.table
    processes = 1 + sum(isinstance(p, LlamaServerProvider) for p in spec.config.provider)
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            shape = gguf.read_shape(file)
        kv = shape.kv_bytes_per_token(table.cache_type_k, table.cache_type_v) * table.ctx_size
    except OSError:
        return 0.0
    except gguf.NotGguf:
        kv = 0.0
    return footprint_mib(size, kv, processes=processes, cache_ram_mib=spec.config.cache.ram_mib)


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
