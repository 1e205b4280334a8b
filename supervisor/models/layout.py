"""Whether a model's llama-server children run with ``--swa-full``: the one cache layout choice
that depends on the model file (``model.swa_full``).

A sliding-window model's slot keeps only its window's cells in the SWA layers; saved and restored,
that state cannot spare the prompt (llama-server re-evaluates it all: "forcing full prompt
re-processing due to lack of cache data").  ``--swa-full`` keeps every cell, at the memory of a
full cache in those layers, and makes the restore usable.
"""

from __future__ import annotations

from ..config import Config, locate
from ..config.modelspec import ModelSpec
from ..llama import gguf
from .memory import estimate_mib


def sliding_window(spec: ModelSpec) -> int | None:
    """The model's sliding window, from its GGUF header; None without one or unreadable."""
    return sliding_window_of(spec.config)


def sliding_window_of(config: Config) -> int | None:
    """As :func:`sliding_window`, for a one-model config."""
    path = locate.model_path(config.model.path)
    if path is None:
        return None
    try:
        with open(path, "rb") as file:
            return gguf.read_shape(file).sliding_window
    except (OSError, gguf.NotGguf):
        return None


def swa_full(spec: ModelSpec, budget_mib: int) -> bool:
    """``model.swa_full`` resolved: "auto" is on for a model with a sliding window whose memory
    estimate with the full cache fits ``budget_mib`` (0: no budget, it fits)."""
    asked = spec.table.swa_full
    if isinstance(asked, bool):
        return asked
    if sliding_window(spec) is None:
        return False
    return budget_mib <= 0 or estimate_mib(spec, swa_full=True) <= budget_mib
