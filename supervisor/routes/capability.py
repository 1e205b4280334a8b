"""What a model's restores can do in this llama.cpp, proven at its load: the probe and its verdict.

llama.cpp's slot restore answers success on every model, and on some the next request still
re-evaluates the whole prompt ("forcing full prompt re-processing due to lack of cache data (likely
due to SWA or hybrid/recurrent memory)", ggml-org/llama.cpp#26676).  A handoff or a prefix-store
restore there pays for the prompt twice.  So each load of a model starts with a probe on its decoder,
in a slot of its own, before the model takes requests (:func:`probe`):

    prefill P, save, erase, restore, ask P for one token   prompt_n <= 2  whole
    the same with P less its last token saved               prompt_n <= 2  prefix
    otherwise                                                              none

``whole``: a state restores as saved (dense and MoE models; sliding-window ones under
``--swa-full``).  ``prefix``: recurrent memory (Qwen3.5, LFM2, Granite 4) cannot be cut back to an
earlier token, but a state saved short of the prompt leaves the decoder the rest to evaluate: what is
handed over or kept ends where the conversation's next request still matches the prompt
(:attr:`Capability.at_boundary`; routes/prompt.py's ``boundary``): a chat's before its generation
prompt, a text's less its last token (:attr:`Capability.short_by`).  ``none``: the hybrid routes
and the prefix store are off for the model, each request says ``fallback=restore-unusable``.
``unprobed``: the probe could not run (its reason is kept); the routes run as before and the check
after each handoff still watches.

A model the probe passed whose decoder still re-evaluates a restored prompt loses the capability for
the rest of the load (:meth:`Capability.withdraw`), said once at warning.
"""

from __future__ import annotations

import enum
import logging
import secrets
from pathlib import Path

import trio

from ..llama import decoder
from ..llama.decoder import JsonClient, Refusal

log = logging.getLogger("onebit.model")

# A re-asked prompt whose restore was used evaluates its last token, or two: llama-server keeps one
# back to compute the logits from.
USED_PROMPT_N = 2
# The probe's prompt: past the sliding windows of the families we know (Gemma 3's tiny test models
# slide over 32 tokens), short enough to cost well under a second on a CPU.
PROBE_TOKENS = 160
_PROBE_TEXT = (
    "A probe of whether a saved slot restores: the quick brown fox jumps over the lazy dog, "
    "and the five boxing wizards jump quickly. "
)


class Restores(enum.Enum):
    UNPROBED = "unprobed"
    WHOLE = "whole"
    PREFIX = "prefix"
    NONE = "none"


def verdict(whole_prompt_n: int | None, short_prompt_n: int | None) -> Restores:
    """The capability from the two re-asks' ``prompt_n`` (None: that re-ask was not made or did not
    say).  Pure."""
    if whole_prompt_n is not None and whole_prompt_n <= USED_PROMPT_N:
        return Restores.WHOLE
    if short_prompt_n is not None and short_prompt_n <= USED_PROMPT_N:
        return Restores.PREFIX
    if whole_prompt_n is None and short_prompt_n is None:
        return Restores.UNPROBED
    return Restores.NONE


def probe_length(slot_context: int | None) -> int:
    """The probe prompt's tokens: PROBE_TOKENS, within half a slot."""
    if slot_context is None:
        return PROBE_TOKENS
    return max(8, min(PROBE_TOKENS, slot_context // 2))


class Capability:
    """One model's restore capability for one load: written by its probe and by the requests that
    find it wanting, read by every request's route decision and by the prefix store."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.restores = Restores.UNPROBED
        self.why = "not probed yet"
        self.withdrawn: str | None = None
        # Set once the probe has given its verdict (or could not run).
        self.known = trio.Event()

    @property
    def handoff(self) -> bool:
        """A provider's state, handed over, spares the decoder the prompt."""
        return self.withdrawn is None and self.restores is not Restores.NONE

    @property
    def store(self) -> bool:
        """A stored prefix, restored, spares the decoder that prefix."""
        return self.handoff

    @property
    def at_boundary(self) -> bool:
        """A state cannot be cut back: what is handed over or kept ends at the prompt's boundary
        (routes/prompt.py), never after it (a slot saved after a reply holds the reply too)."""
        return self.restores is Restores.PREFIX

    @property
    def short_by(self) -> int:
        """How many of the prompt's last tokens a handed-over state leaves out."""
        return 1 if self.restores is Restores.PREFIX else 0

    def handed_over(self, tokens: list[int], end: int | None) -> list[int]:
        """The prompt's tokens a state handed over holds: up to ``end``, the prompt's boundary
        (routes/boundary.py), where the state cannot be cut back and the boundary is known; else all
        but the last :attr:`short_by`."""
        if self.at_boundary and end is not None and 0 < end < len(tokens):
            return tokens[:end]
        if 0 < self.short_by < len(tokens):
            return tokens[: -self.short_by]
        return tokens

    @property
    def words(self) -> str:
        if self.withdrawn is not None:
            return f"withdrawn: {self.withdrawn}"
        return f"{self.restores.value}: {self.why}"

    def set(self, restores: Restores, why: str) -> None:
        self.restores, self.why = restores, why
        self.known.set()

    def withdraw(self, why: str) -> None:
        """The decoder re-evaluated a prompt it was given restored: no more restores this load."""
        if self.withdrawn is not None:
            return
        self.withdrawn = why
        log.warning(
            "model %s: restores withdrawn until its next load (the hybrid routes and the prefix store are off): %s",
            self.model,
            why,
        )


class _Failed(Exception):
    """A probe step was refused: the probe ends unprobed with these words."""


async def _ask(
    client: JsonClient, slot: int, tokens: list[int], saved: list[int], path: Path, touched: list[bool]
) -> int | None:
    """Prefill ``saved`` into ``slot``, save it to ``path``, erase the slot, restore the file and ask
    ``tokens`` for one token: its ``prompt_n``.  ``touched`` is set once the slot holds anything."""
    done = await decoder.prefill(client, slot, saved)
    if isinstance(done, Refusal):
        raise _Failed(str(done))
    touched[0] = True
    wrote = await decoder.save(client, slot, path.name)
    if isinstance(wrote, Refusal):
        raise _Failed(str(wrote))
    erased = await decoder.erase(client, slot)
    if erased is not None:
        raise _Failed(str(erased))
    restored = await decoder.restore(client, slot, path.name, len(saved))
    if restored is not None:
        raise _Failed(str(restored))
    answer = await decoder.next_token(client, slot, tokens, n_probs=0, cache=True)
    if isinstance(answer, Refusal):
        raise _Failed(str(answer))
    return answer.prompt_n


async def prompt_tokens(client: JsonClient, n: int) -> list[int]:
    """``n`` tokens of the probe's text in the model's own vocabulary.  Raises DecoderError."""
    unit = await decoder.tokenize(client, _PROBE_TEXT)
    if not unit:
        return []
    tokens = list(unit)
    while len(tokens) < n:
        tokens += unit[1:] if len(unit) > 1 else unit
    return tokens[:n]


async def probe(client: JsonClient, slot: int, tokens: list[int], state_dir: Path) -> tuple[Restores, str]:
    """The verdict for ``tokens`` in ``slot`` (which the caller holds, empty), and the words for it.
    Never raises for the decoder: a step it refuses gives ``unprobed`` with its words.  The slot is
    erased and the state files removed on the way out."""
    name = f"probe-{secrets.token_hex(4)}"
    whole, short = state_dir / f"{name}-whole.state", state_dir / f"{name}-short.state"
    whole_n: int | None = None
    touched = [False]  # a decoder that refused the first prefill was left as it was
    try:
        whole_n = await _ask(client, slot, tokens, tokens, whole, touched)
        if verdict(whole_n, None) is Restores.WHOLE:
            return Restores.WHOLE, f"a restored state spared the prompt (re-asked: {whole_n} of {len(tokens)})"
        await decoder.erase(client, slot)
        short_n = await _ask(client, slot, tokens, tokens[:-1], short, touched)
    except _Failed as exc:
        if whole_n is not None:
            return Restores.NONE, f"a restored state re-evaluated {whole_n} of {len(tokens)}; then {exc}"
        return Restores.UNPROBED, f"the probe could not run: {exc}"
    finally:
        if touched[0]:
            with trio.CancelScope(shield=True):
                await decoder.erase(client, slot)
        for path in (whole, short):
            path.unlink(missing_ok=True)
    found = verdict(whole_n, short_n)
    if found is Restores.PREFIX:
        return found, (
            f"a restored state re-evaluated the prompt ({whole_n} of {len(tokens)} tokens, recurrent or"
            f" sliding-window memory); one saved a token short spared it (re-asked: {short_n})"
        )
    return found, (
        f"a restored state re-evaluated the prompt ({whole_n} of {len(tokens)} tokens), and one saved a token"
        f" short too ({short_n})"
    )
