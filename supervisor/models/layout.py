"""Whether a model's llama-server children run with ``--swa-full``: the one cache layout choice
that depends on the model file (``model.swa_full``).

A sliding-window model's slot keeps only its window's cells in the SWA layers; saved and restored,
that state cannot spare the prompt (llama-server re-evaluates it all: "forcing full prompt
re-processing due to lack of cache data").  ``--swa-full`` keeps every cell, at the memory of a
full cache in those layers, and makes the restore usable.
"""

from __future__ import annotations

from ..config.modelspec import ModelSpec
from .memory import ModelFile, estimate_mib


def swa_full(spec: ModelSpec, found: ModelFile | None, budget_mib: int) -> bool:
    """``model.swa_full`` resolved: "auto" is on for a model with a sliding window (in its file
    ``found``, :func:`~supervisor.models.memory.read_model`) whose memory estimate with the full cache
    fits ``budget_mib`` (0: no budget, it fits)."""
    asked = spec.table.swa_full
    if isinstance(asked, bool):
        return asked
    if found is None or found.sliding_window is None:
        return False
    return budget_mib <= 0 or estimate_mib(spec, found, swa_full=True) <= budget_mib
