"""How every llama-server of one load of a model keeps its KV cache: the :class:`Layout` its parts are
built from, the same for the decoder and each llama-server provider (a state file one writes is one
the other restores).

Two choices make it.  ``--swa-full`` (``model.swa_full``) depends on the model file: a
sliding-window model's slot keeps only its window's cells in the SWA layers; saved and restored,
that state cannot spare the prompt (llama-server re-evaluates it all: "forcing full prompt
re-processing due to lack of cache data").  ``--swa-full`` keeps every cell, at the memory of a
full cache in those layers, and makes the restore usable.  ``--kv-unified`` depends on the
providers' devices: one on the OpenVINO static path (an NPU) writes files with one KV stream, which
only a unified-KV decoder restores (supervisor/llama/openvino.py); the model asks the devices once,
before its first start (supervisor/models/model.py's ``choose_layout``), and every load takes them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import attrs

from ..config.modelspec import ModelSpec
from ..llama.openvino import UNIFIED_ARGS
from ..providers.llama import LlamaServerProvider
from .memory import ModelFile, estimate_mib

log = logging.getLogger("onebit.model")


@attrs.frozen
class Layout:
    """One load's KV layout: ``swa_full`` and ``kv_unified`` for every llama-server child of the
    load, and each OpenVINO provider's device (by provider name) as its runtime named it."""

    swa_full: bool = False
    kv_unified: bool = False
    devices: Mapping[str, str] = attrs.field(factory=dict, hash=False)


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


async def choose(providers: Sequence[LlamaServerProvider]) -> Layout:
    """The devices and ``kv_unified``: each OpenVINO provider asks its runtime for its device (a
    runtime that cannot say refuses it), then one on the static path unifies every KV."""
    for provider in providers:
        if provider.engine == "openvino" and provider.device is None:
            await provider.choose_device()
    kv_unified = any(p.static for p in providers if p.refused is None)
    if kv_unified:
        log.info("a provider takes the static path: every llama-server runs with %s", " ".join(UNIFIED_ARGS))
    devices = {p.name: p.device for p in providers if p.engine == "openvino" and p.device is not None}
    return Layout(kv_unified=kv_unified, devices=devices)
