"""What a start admits, before the model takes requests or a provider takes a job: the context each
decoder slot really got, what a restore can do (the probe, supervisor/routes/capability.py), and each
provider's start-time check (supervisor/routes/fidelity.py).

Each step returns one value and writes nothing: :func:`admit` returns the decoder start's
:class:`Admission`, :func:`check` a provider's :class:`~supervisor.providers.base.Checked`.  The
load (supervisor/models/parts.py) keeps them: the capability its requests read, the slot context
its completions plan with, the verdict its next load takes unprobed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs
import trio

from ..config import ModelConfig
from ..errors import DecoderError, ProviderStateRefused
from ..llama import decoder as decoder_api
from ..llama.decoder import DecoderClient, SlotContext
from ..llama.slots import SlotPool
from ..providers import Provider
from ..providers.base import Checked
from ..routes import capability, fidelity
from ..routes.capability import Capability, Restores
from ..routes.file import FileHandoff
from ..routes.handover import learn
from ..routes.rates import Rates
from ..supervise.child import Child, ChildState

log = logging.getLogger("onebit.model")

# What each verdict means for the model's requests, in its load's log line.
_VERDICT_WORDS = {
    Restores.WHOLE: "the hybrid routes and the prefix store are on",
    Restores.PREFIX: "what the file route hands over and the prefix store keeps ends at the prompt's boundary",
    Restores.NONE: "the hybrid routes and the prefix store are off (fallback=restore-unusable)",
    Restores.UNPROBED: "the routes run unproven, each handoff checked after",
}


@attrs.frozen
class Admission:
    """What one start of the decoder found: the context each slot got (None: it did not say), and
    what a restore can do, with why.  ``probed``: the probe ran now (its verdict is one the model's
    later starts may take unprobed, unless it could not run)."""

    slot_context: SlotContext | None
    restores: Restores
    why: str
    probed: bool = False


@attrs.frozen
class Start:
    """One start of a model's decoder, as admission sees it: the model's name and ``[model]`` table,
    its decoder's client, slots and ``--slot-save-path``, and whether its file slides with
    ``--swa-full`` off (a probe that finds no restore says what would help)."""

    name: str
    table: ModelConfig
    client: DecoderClient
    slots: SlotPool
    state_dir: Path
    slides: bool = False


async def admit(start: Start, *, restoring: bool, proven: tuple[Restores, str] | None) -> Admission:
    """The slot context, then the restore verdict: none where nothing is restored (``restoring``
    false: no provider, no prefix store), ``proven`` where an earlier start's probe found it (the
    same build, flags and file), else the probe's."""
    found = await _read_context(start)
    if not restoring:
        why = "nothing is restored here (no provider, no prefix store)"
        log.info("model %s: no restore probe: %s", start.name, why)
        return Admission(found, Restores.UNPROBED, why)
    if proven is not None:
        log.debug("model %s: restores %s, as its first start's probe found", start.name, proven[0].value)
        return Admission(found, *proven)
    restores, why = await _probe(start, found)
    hint = ""
    if restores is Restores.NONE and start.slides:
        hint = " (a sliding-window model: model.swa_full = true would keep its whole cache)"
    log.log(
        logging.WARNING if restores is Restores.NONE else logging.INFO,
        "model %s: restores %s: %s; %s%s",
        start.name,
        restores.value,
        why,
        _VERDICT_WORDS[restores],
        hint,
    )
    return Admission(found, restores, why, probed=True)


async def _read_context(start: Start) -> SlotContext | None:
    try:
        found = await decoder_api.context(start.client)
    except DecoderError as exc:
        log.warning("model %s: cannot read the decoder's slot context: %s", start.name, exc)
        return None
    if found is None:
        return None
    table = start.table
    asked = table.ctx_size // table.parallel
    if found.n_ctx < asked:
        train = f" of {found.n_ctx_train}" if found.n_ctx_train is not None else ""
        log.warning(
            "model %s: model.ctx_size = %d over model.parallel = %d asks %d tokens a slot, over the model's"
            " training context%s: each slot got %d tokens",
            start.name,
            table.ctx_size,
            table.parallel,
            asked,
            train,
            found.n_ctx,
        )
    return found


async def _probe(start: Start, found: SlotContext | None) -> tuple[Restores, str]:
    n_ctx = found.n_ctx if found is not None else None
    try:
        tokens = await capability.prompt_tokens(start.client, capability.probe_length(n_ctx))
    except DecoderError as exc:
        return Restores.UNPROBED, f"the probe could not tokenize: {exc}"
    async with start.slots.hold() as slot:
        try:
            return await capability.probe(start.client, slot, tokens, start.state_dir)
        finally:
            start.slots.forget(slot)


@attrs.frozen
class Gauge:
    """What a provider's start-time check measures with: the load's decoder, its client, slots and
    ``--slot-save-path`` (where the states it compares are saved), its restore capability, the file
    handoff it hands over through, the rates its prefills teach, and the prefill timeout and the slot
    context as they are at the check.  ``must_be_faster``: a
    prefill no faster than the decoder's own engine's is refused too (engine "auto")."""

    decoder: Child
    client: DecoderClient
    slots: SlotPool
    state_dir: Path
    capability: Capability
    handoff: FileHandoff
    rates: Rates
    timeout_s: float
    slot_context: int | None
    must_be_faster: bool = False


async def check(provider: Provider, gauge: Gauge) -> Checked:
    """A provider's start-time check: a few prompts through the decoder's three paths, in a slot
    held like a request's, once the decoder is ready and its probe said what restores; each
    prompt's handed-over state against the decoder's own, its recurrent parts on every prompt (a
    state may go wrong only after earlier prompts), its KV caches' values on the first (their cost,
    supervisor/routes/statecheck.py).  Admitted
    unmeasured where nothing restores.  Raises ProviderError when it cannot finish (the decoder or
    the provider went away)."""
    await gauge.decoder.wait_state(ChildState.READY)
    # The probe first (it may need the only slot), and nothing to measure where nothing restores.
    await gauge.capability.known.wait()
    if not gauge.capability.handoff:
        return Checked()
    probe = fidelity.Probe(
        client=gauge.client,
        handoff=gauge.handoff,
        timeout_s=gauge.timeout_s,
        state_dir=gauge.state_dir,
        short_by=gauge.capability.short_by,
    )
    prompts = fidelity.fitting([await probe.tokens(text) for text in fidelity.GATE_PROMPTS], gauge.slot_context)
    started = trio.current_time()
    async with gauge.slots.hold() as slot:
        try:
            samples = [
                await probe.sample(provider, slot, tokens, req=f"fidelity-{provider.name}-{i}", kv_state=i == 0)
                for i, tokens in enumerate(prompts)
            ]
        except ProviderStateRefused as exc:
            return Checked(refused=str(exc))
        finally:
            gauge.slots.forget(slot)
    _learn(gauge, provider, samples)
    verdict = fidelity.judge(samples)
    refused = verdict.refusal(must_be_faster=gauge.must_be_faster)
    if refused is not None:
        return Checked(refused=refused)
    log.info("provider %s: admitted in %.1fs: %s", provider.name, trio.current_time() - started, verdict.summary())
    return Checked(admitted=verdict.summary())  # onebitctl status and the status page show it


def _learn(gauge: Gauge, provider: Provider, samples: list[fidelity.Sample]) -> None:
    """The check's prefills, cold on the decoder and handed over from the provider, are the rates'
    first measurements: on shared cores a provider is taken only where it is measured cheaper, and
    nothing else would measure it first."""
    for sample in samples:
        gauge.rates.observe_decoder(gauge.decoder.generation, sample.n_tokens, sample.cold_ms)
        if sample.outcome is not None and sample.outcome.ok:
            learn(gauge.rates, provider.name, sample.n_tokens, sample.outcome)
