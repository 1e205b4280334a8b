"""How far a provider's prompt state moves the decoder's next-token distribution, and the bound it
must stay within.

Across engines identical replies cannot be had (OpenVINO computes the same model with other kernels,
other rounding, other quantized activations); what can be held is a distance no worse than the
decoder's own choice of path already makes.  For one prompt, the decoder's distribution of the token
after it, three ways:

    cached    the decoder evaluates only the prompt's last token, over the KV it prefilled itself
              (what its prompt cache does for a repeated prompt)
    cold      the decoder prefills the whole prompt at once (cache_prompt false)
    handoff   the decoder evaluates only the last token, over the KV the provider prefilled and the
              file route restored (what every hybrid request does)

    d_handoff = TV(handoff, cached)        d_cold = TV(cold, cached)

Each distribution is llama-server's pre-sampling top-k (``n_probs``: the softmax of the logits), TV
the total variation distance over the union of both top-k token sets plus one bucket for the rest of
the mass (a token in one list and not the other counts as 0 in the other: an upper bound on what the
lists hide, within the smaller tail).  The bound, over a set of prompts, on the mean and on the
worst prompt (one prompt far off must not hide behind good ones):

    mean(d_handoff) <= FACTOR * mean(d_cold) + FLOOR
    max(d_handoff)  <= FACTOR * max(d_cold)  + FLOOR

The same handoff's state is compared with the decoder's own for the same tokens
(supervisor/routes/statecheck.py): a provider is admitted only where that is within STATE_BOUND too
and no cell differs.  The distance alone admits a wrong state wherever the logits barely move with it.

A ggml provider runs the decoder's own engine: its d_handoff is 0 (tests hold it to identical
replies instead).

The same prompts time both engines: the decoder's cold prefill and the provider's prefill in the
handoff, each in ms a prompt token (the median over the prompts, so that one prompt paying a
compile does not decide).  A provider whose engine was chosen for it (engine "auto") is admitted
only where it is also faster (:meth:`Verdict.refusal`): an OpenVINO server slower than the decoder's
own engine on this model costs its memory and its start for nothing, and ggml goes on instead.

The pure part (:func:`top_k`, :func:`total_variation`, :func:`judge`) does no I/O; :class:`Probe`
measures through llama-server's typed calls (supervisor/llama/decoder.py: tokenize, next_token,
prefill, save, erase) and the file route's own handoff.
"""

from __future__ import annotations

import math
import secrets
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import trio

from ..errors import DecoderError, ProviderError, ProviderStateRefused
from ..llama import decoder
from ..providers import Provider
from .decision import Outcome, Step
from .gate_prompts import GATE_PROMPTS as GATE_PROMPTS
from .gate_prompts import LONG_PROMPTS as LONG_PROMPTS
from .gate_prompts import START_PROMPTS as START_PROMPTS
from .gate_prompts import fitting as fitting
from .gate_prompts import prompt_set as prompt_set
from .statecheck import STATE_BOUND, StateCheck, compare_files
from .statecheck import summary as state_summary
from .statecheck import worst as worst_state

# The top-k llama-server reports; 20 is the OpenAI API's top_logprobs maximum, and holds all but a
# few thousandths of the mass of a 135M model's next token on ordinary text.
TOP_K = 20
# The bound's constants (docs/benchmarks.md, "Fidelity across engines", for the measurement they come
# from): a provider may move the decoder's next token FACTOR times as far as the decoder's own cold
# prefill does, plus FLOOR for prompts where the cold path happens to agree exactly.
FACTOR = 3.0
FLOOR = 0.02


# A path over the slot's own cells that evaluated up to this many tokens was still the cached one (a
# hybrid model's decoder resumes from a context checkpoint a few tokens back).
CHECKPOINT_TOKENS = 16

# What the probe needs of the decoder's client: llama-server's typed calls take it (a fake in tests).
Client = decoder.JsonClient


class Handoff(Protocol):
    """The file route's effects (supervisor/routes/file.py's FileHandoff)."""

    async def run(self, *, req: str, slot: int, tokens: list[int], provider: Provider, timeout_s: float) -> Outcome: ...


def top_k(reply: Any) -> dict[int, float]:
    """Token id to probability, from a /completion reply with ``n_probs`` (the first token's list)."""
    try:
        first = reply["completion_probabilities"][0]
        entries = first["top_logprobs"]
        return {int(e["id"]): math.exp(float(e["logprob"])) for e in entries}
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(f"no top-k probabilities in the reply: {exc!r}") from None


def total_variation(p: Mapping[int, float], q: Mapping[int, float]) -> float:
    """Half the L1 distance over the union of both supports, the rest of each mass as one bucket."""
    union = p.keys() | q.keys()
    listed = sum(abs(p.get(t, 0.0) - q.get(t, 0.0)) for t in union)
    rest = abs(max(0.0, 1.0 - sum(p.values())) - max(0.0, 1.0 - sum(q.values())))
    return min(1.0, 0.5 * (listed + rest))


def top1(p: Mapping[int, float]) -> int:
    return max(p, key=lambda t: p[t])


@attrs.frozen
class Sample:
    """One prompt's three distributions, compared."""

    n_tokens: int
    handoff: float  # TV(handoff, cached)
    cold: float  # TV(cold, cached)
    same_top1: bool  # the handoff's most likely next token is the cached path's
    # What the paths cost, for the rates (supervisor/routes/rates.py): the decoder's cold prefill of
    # the prompt, and the handoff's outcome (the provider's prefill, the state moved).
    cold_ms: float | None = None
    outcome: Outcome | None = None
    # The handed-over state against the decoder's own for the same tokens; None: not compared.
    state: StateCheck | None = None


@attrs.frozen
class Verdict:
    n: int
    mean_handoff: float
    mean_cold: float
    max_handoff: float
    top1_agree: float  # fraction of prompts whose top-1 token the handoff kept
    bound: float  # factor * mean_cold + floor
    factor: float = FACTOR
    floor: float = FLOOR
    max_cold: float = 0.0
    worst_bound: float = math.inf  # factor * max_cold + floor
    # Prefill speed, ms a prompt token (the median over the prompts): the provider's in the
    # handoff, the decoder's cold; None where a side gave no figure.
    provider_ms_per_token: float | None = None
    decoder_ms_per_token: float | None = None
    # Each prompt's state check, where one ran (statecheck.py: every error <= STATE_BOUND, no cell
    # differing).
    states: tuple[StateCheck, ...] = ()
    state_bound: float = STATE_BOUND

    @property
    def state(self) -> StateCheck | None:
        """The state check that decides (the worst), None where none ran."""
        return worst_state(self.states)

    @property
    def ok(self) -> bool:
        state_ok = self.state is None or self.state.ok
        return self.mean_handoff <= self.bound and self.max_handoff <= self.worst_bound and state_ok

    @property
    def faster(self) -> bool | None:
        """The provider prefilled faster than the decoder's own engine; None: not measured."""
        if self.provider_ms_per_token is None or self.decoder_ms_per_token is None:
            return None
        return self.provider_ms_per_token < self.decoder_ms_per_token

    def summary(self) -> str:
        return f"{self.distance()}; {state_summary(self.states)}"

    def distance(self) -> str:
        """The next-token distances and the speeds, in one line."""
        return (
            f"next-token TV distance over {self.n} prompts: handoff mean {self.mean_handoff:.4f}"
            f" (worst {self.max_handoff:.4f}), the decoder's own cold prefill {self.mean_cold:.4f}"
            f" (worst {self.max_cold:.4f}), bounds {self.bound:.4f} and {self.worst_bound:.4f}"
            f" ({self.factor:g} x cold + {self.floor:g}); top-1 kept on {self.top1_agree:.0%}; {self.speed()}"
        )

    def speed(self) -> str:
        def rate(ms: float | None) -> str:
            return "not measured" if ms is None else f"{ms:.3g} ms a token"

        return (
            f"prefill {rate(self.provider_ms_per_token)}, the decoder's own engine"
            f" {rate(self.decoder_ms_per_token)} (medians over the prompts)"
        )

    def refusal(self, *, must_be_faster: bool) -> str | None:
        """Why the provider is refused, or None: admitted.  ``must_be_faster``: its engine was
        chosen for it (engine "auto"), and is kept only where it prefills faster than the decoder's."""
        if self.state is not None and not self.state.ok:
            return f"{state_summary(self.states)}: over the bound; {self.distance()}"
        if not self.ok:
            return f"{self.summary()}: over the bound"
        if must_be_faster and not self.faster:
            return f"{self.speed()}: not faster than the decoder's own engine on this model"
        return None


def judge(samples: Sequence[Sample], *, factor: float | None = None, floor: float | None = None) -> Verdict:
    """The verdict over ``samples`` (``factor``, ``floor``: the bound's, FACTOR and FLOOR unless given)."""
    if not samples:
        raise ValueError("no samples to judge")
    factor = FACTOR if factor is None else factor
    floor = FLOOR if floor is None else floor
    mean_cold = statistics.fmean(s.cold for s in samples)
    max_cold = max(s.cold for s in samples)
    provider_ms, decoder_ms = _speeds(samples)
    return Verdict(
        n=len(samples),
        mean_handoff=statistics.fmean(s.handoff for s in samples),
        mean_cold=mean_cold,
        max_handoff=max(s.handoff for s in samples),
        top1_agree=sum(s.same_top1 for s in samples) / len(samples),
        bound=factor * mean_cold + floor,
        factor=factor,
        floor=floor,
        max_cold=max_cold,
        worst_bound=factor * max_cold + floor,
        provider_ms_per_token=provider_ms,
        decoder_ms_per_token=decoder_ms,
        states=tuple(s.state for s in samples if s.state is not None),
    )


def _speeds(samples: Sequence[Sample]) -> tuple[float | None, float | None]:
    """The provider's and the decoder's prefill, ms a prompt token, each the median over the
    prompts it gave a figure for (the provider's over the tokens it evaluated: its cache may hold
    the start of a prompt)."""
    provider = [
        s.outcome.prefill_ms / (s.outcome.evaluated or s.n_tokens)
        for s in samples
        if s.outcome is not None and s.outcome.ok and s.outcome.prefill_ms is not None
    ]
    decoder = [s.cold_ms / s.n_tokens for s in samples if s.cold_ms is not None]
    return (
        statistics.median(provider) if provider else None,
        statistics.median(decoder) if decoder else None,
    )


class Probe:
    """Measures :class:`Sample` for a provider through the decoder, in a decoder slot the caller holds.
    ``state_dir``: the decoder's ``--slot-save-path``, where the states are saved to be compared (None:
    they are not); ``short_by``: how many tokens short of the prompt the file route hands over
    (supervisor/routes/capability.py)."""

    def __init__(
        self,
        *,
        client: Client,
        handoff: Handoff,
        timeout_s: float,
        k: int = TOP_K,
        state_dir: Path | None = None,
        short_by: int = 0,
    ) -> None:
        self.client = client
        self.handoff = handoff
        self.timeout_s = timeout_s
        self.k = k
        self.state_dir = state_dir
        self.short_by = short_by

    async def tokens(self, text: str) -> list[int]:
        """``text`` as the decoder's completion path tokenizes it.  Raises ProviderError."""
        try:
            return await decoder.tokenize(self.client, text)
        except DecoderError as exc:
            raise ProviderError(f"fidelity: {exc.message}") from exc

    async def sample(
        self, provider: Provider, slot: int, tokens: list[int], req: str = "fidelity", *, kv_state: bool = True
    ) -> Sample:
        """The three paths for one prompt, and the handed-over state against the decoder's own where
        ``state_dir`` is set (``kv_state``: its KV caches' values too, else only its recurrent parts);
        the slot is erased before and after, the saved states removed.  Raises ProviderError."""
        # What the file route hands over (supervisor/routes/file.py): the prompt, or less its end.
        handed = tokens[: len(tokens) - self.short_by] if 0 < self.short_by < len(tokens) else tokens
        own = provided = None
        if self.state_dir is not None:
            # Our names, random: a check run again must not meet the files of one cut short.
            name = f"{req}-{secrets.token_hex(4)}"
            own, provided = self.state_dir / f"{name}-own.state", self.state_dir / f"{name}-provided.state"
        state = None
        await self._erase(slot)
        try:
            if own is not None:
                # The decoder's own state of exactly the handed tokens; the cached path below then
                # evaluates the rest (a hybrid model's last token) over it.
                await self._prefill(slot, handed)
                await self._save(slot, own)
            await self._next(slot, tokens, cache=True)
            cached = await self._next(slot, tokens, cache=True, evaluated=1)
            cold_answer = await self._ask(slot, tokens, cache=False, evaluated=len(tokens))
            cold = _distribution(cold_answer)
            outcome = await self.handoff.run(
                req=req, slot=slot, tokens=tokens, provider=provider, timeout_s=self.timeout_s
            )
            if outcome.failed is Step.RESTORE:
                raise ProviderStateRefused(f"the decoder refused its state: {outcome.why}")
            if outcome.answered:
                # Its engine answered an error of its own (OpenVINO's "Compute error" on a model it
                # cannot take): asking again would get the same answer.
                raise ProviderStateRefused(f"it cannot prefill this model: {outcome.why}")
            if not outcome.ok:
                raise ProviderError(f"fidelity: the handoff failed: {outcome.why}")
            if provided is not None:
                await self._save(slot, provided)  # the restored slot: the provider's state, as handed over
            handoff = await self._next(slot, tokens, cache=True, evaluated=1)
            if own is not None and provided is not None:
                state = await trio.to_thread.run_sync(lambda: compare_files(provided, own, kv=kv_state))
        finally:
            await self._erase(slot)
            for path in (own, provided):
                if path is not None:
                    # Synchronous on purpose: an await here could be cancelled and leave the file.
                    path.unlink(missing_ok=True)
        return Sample(
            n_tokens=len(tokens),
            handoff=total_variation(handoff, cached),
            cold=total_variation(cold, cached),
            same_top1=top1(handoff) == top1(cached),
            cold_ms=cold_answer.prompt_ms,
            outcome=outcome,
            state=state,
        )

    async def _prefill(self, slot: int, tokens: list[int]) -> None:
        done = await decoder.prefill(self.client, slot, tokens)
        if isinstance(done, decoder.Refusal):
            raise ProviderError(f"fidelity: the decoder's prefill: {done.words}")

    async def _save(self, slot: int, path: Path) -> None:
        saved = await decoder.save(self.client, slot, path.name)
        if isinstance(saved, decoder.Refusal):
            raise ProviderError(f"fidelity: the decoder's save of its slot: {saved.words}")

    async def _next(
        self, slot: int, tokens: list[int], *, cache: bool, evaluated: int | None = None
    ) -> dict[int, float]:
        return _distribution(await self._ask(slot, tokens, cache=cache, evaluated=evaluated))

    async def _ask(
        self, slot: int, tokens: list[int], *, cache: bool, evaluated: int | None = None
    ) -> decoder.NextToken:
        answer = await decoder.next_token(self.client, slot, tokens, n_probs=self.k, cache=cache)
        if isinstance(answer, decoder.Refusal):
            if answer.status == 0:
                raise ProviderError(f"fidelity: {answer.words}")
            raise ProviderError(f"fidelity: the decoder answered {answer.status}: {str(answer.data)[:200]}")
        prompt_n = answer.prompt_n
        # Over its own cells a hybrid model's decoder goes back to its last context checkpoint, a few
        # tokens before the end: still its cached path.
        tolerance = CHECKPOINT_TOKENS if evaluated == 1 else 1
        if evaluated is not None and prompt_n is not None and abs(prompt_n - evaluated) > tolerance:
            # The path was not the one asked for (a cache the decoder did not use): no measurement.
            raise ProviderError(f"fidelity: the decoder evaluated {prompt_n} tokens where {evaluated} were due")
        return answer

    async def _erase(self, slot: int) -> None:
        refused = await decoder.erase(self.client, slot)
        if refused is not None and refused.status == 0:
            raise ProviderError(f"fidelity: {refused.words}")


def _distribution(answer: decoder.NextToken) -> dict[int, float]:
    try:
        return top_k(answer.reply)
    except ValueError as exc:
        raise ProviderError(f"fidelity: {exc}") from None
