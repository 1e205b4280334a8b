"""A hybrid model's prompt boundary: where what is handed over or kept of a prompt ends, for a model
whose state cannot be cut back to an earlier token (supervisor/routes/capability.py's ``prefix``).

A dense model's state is cut back to any earlier token, so its handoffs and its prefix-store entries
hold the whole prompt.  A hybrid model's (recurrent or convolution layers beside attention) cannot
be: a state that holds a token the next request does not start with is of no use to it.  So what is
handed over or kept for it ends where the conversation's next request still matches the prompt token
for token (:func:`find`), and the decoder evaluates the rest: the generation prompt, a handful of
tokens.  On the plain route the decoder first prefills up to the boundary alone and the slot is
saved there (:func:`keeping`, routes/stored.py's ``StoredPrefixes.mark``); a handoff leaves the slot
at the boundary already.  The saved state is committed to the prefix store once the reply is over,
and removed on every other path.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import attrs

from ..errors import DecoderError
from ..llama import decoder
from ..llama.decoder import JsonClient
from ..llama.slots import SlotPool
from ..prefix.store import Entry
from ..reasons import Reason
from .capability import Capability
from .decision import Route
from .plan import Plan
from .prompt import Chat, Text, Tokens, template
from .stored import Marked, StoredPrefixes
from .story import Story
from .usage import Prefill

log = logging.getLogger("onebit.hybrid")


async def find(client: JsonClient, prompt: Chat | Text | Tokens, tokens: tuple[int, ...]) -> int | None:
    """How many of ``tokens`` (the prompt's) a state that the conversation's next request can use
    holds, for a model whose state cannot be cut back to an earlier token (a hybrid one): None where
    there is no such point.

    A chat's next turn re-renders its messages and adds its reply and the new message after them, so
    it matches this one token for token up to the template's generation prompt (the assistant turn's
    opening): the messages are rendered without it (``add_generation_prompt: false``) and tokenized,
    and the boundary is where those tokens and the prompt's part.  Where the messages' last token
    merges with what follows it (a vocabulary without the template's markers as special tokens), that
    is a token or two before the messages end: the next turn, which goes on with the generation
    prompt too, parts there as well.  A text's or tokens' next request is its continuation: the
    prompt less its last token (llama-server keeps one back to compute the logits from), as for a
    chat whose template adds nothing (a continued assistant message).  Raises DecoderError."""
    whole = len(tokens)
    if isinstance(prompt, Chat):
        text = await decoder.apply_template(client, template(prompt, add_generation_prompt=False))
        before = await decoder.tokenize(client, text)
        shared = _shared(before, tokens)
        if 0 < shared < whole:
            return shared
        if shared == 0:
            return None  # rendered otherwise without its generation prompt: no point the next turn keeps
    return whole - 1 if whole > 1 else None


async def entry_end(client: JsonClient, plan: Plan, stored: StoredPrefixes) -> int | None:
    """Where the prefix store's entry for a prompt kept after its reply ends, for a model whose state
    can be cut back: at the chat's boundary (:func:`find`), where its next turn still matches it.  The
    whole prompt ends with the generation prompt, whose last token the next turn may tokenize merged
    with the reply after it (measured on the tiny llama model: the "\n" it ends with and the reply's
    first digits), and an entry holding it is then no prefix of that turn, which restores nothing.
    A raw prompt's ends a token short: its next turn, the prompt and the reply and more text, may
    tokenize its last token merged with the reply likewise.  None: the whole prompt (untokenized, too
    short for the store: no render asked, or a chat's boundary not found); a model whose state cannot
    be cut back keeps its entry at the boundary already (:func:`keeping`)."""
    if stored.at_boundary or plan.tokens is None or len(plan.tokens) < stored.store.min_tokens:
        return None
    if not isinstance(plan.prompt, Chat):
        return len(plan.tokens) - 1 if len(plan.tokens) > 1 else None
    try:
        found = await find(client, plan.prompt, plan.tokens)
    except DecoderError as exc:
        log.info("prefix store: the boundary of a chat could not be found (%s); its entry holds it whole", exc.message)
        return None
    if found is not None and found < len(plan.tokens) - 1:
        # Its messages part from the prompt before the generation prompt's end: a measure of it.  (A
        # chat rendered alike with and without one, a continued assistant message, measures nothing.)
        stored.learn_slack(len(plan.tokens), found)
    return found


async def keep_after(
    client: JsonClient,
    plan: Plan,
    stored: StoredPrefixes | None,
    slot: int,
    slots: SlotPool,
    *,
    req: str,
    restored: Entry | None,
    settle: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """After a reply, on every route: the slot saved for the prefix store up to where the next turn
    still matches (:func:`entry_end`), when the store keeps anything of it.  A chat's end is two calls
    to the decoder while the slot is held: not asked where nothing would be kept wherever it ended
    (``StoredPrefixes.may_keep``: an agent fleet's questions on a stored system prompt).  ``stored``
    None: no store.  ``settle``: awaited before a save (StoredPrefixes.after)."""
    if stored is None or (isinstance(plan.prompt, Chat) and not stored.may_keep(plan.key, slots, restored=restored)):
        return
    # The client has its whole reply and its connection takes its next request meanwhile (the front
    # runs this past the response, supervisor/http/asgi.py): a next turn waits for this slot.
    slots.keeping(slot, plan.key)
    ends = await entry_end(client, plan, stored)
    await stored.after(slot, plan.key, slots, req=req, restored=restored, ends=ends, settle=settle)


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first tokens ``a`` and ``b`` have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


async def bounded(client: JsonClient, capability: Capability | None, plan: Plan, story: Story) -> Plan:
    """The plan with its prompt's boundary (:func:`find`), for a model whose state cannot be cut
    back; the plan as it was for any other, or a prompt not tokenized.  A prompt that has none says
    ``no-boundary`` on its route line: nothing of it is kept."""
    if capability is None or not capability.at_boundary or plan.prompt is None or plan.tokens is None:
        return plan
    try:
        found = await find(client, plan.prompt, plan.tokens)
    except DecoderError as exc:
        log.warning("hybrid: the boundary of %s could not be found (%s); nothing is kept of it", story.req, exc.message)
        found = None
    if found is None:
        story.fell_back(Reason.NO_BOUNDARY)
        log.info("hybrid: %s has no point its next turn still matches; nothing of it is kept", story.req)
    return attrs.evolve(plan, boundary=found)


@attrs.define
class Keeping:
    """A request's boundary state while the rest of its prompt is evaluated: ``marked`` (None: none
    is kept), committed when ``done`` is set once the reply is over."""

    marked: Marked | None
    done: bool = False

    def prefilled(self) -> Prefill | None:
        """The decoder's own prefill up to the boundary, where the plain route made one: the rest's
        reply counts it as cached, and it was not (routes/usage.py)."""
        first = None if self.marked is None else self.marked.prefilled
        return None if first is None else Prefill(first.prompt_n, first.prompt_ms, provider=False)


@asynccontextmanager
async def keeping(
    stored: StoredPrefixes | None, plan: Plan, slot: int, route: Route, story: Story
) -> AsyncIterator[Keeping]:
    """Around the rest of the request: the slot's state at the plan's boundary saved for the prefix
    store first (on the plain route the decoder first evaluates up to it; a handoff left the slot
    there), and committed when the block sets ``done``, else removed, a cancellation included."""
    marked = None
    # The share route lends the whole prompt's state: past the boundary, nothing to keep of it.
    if stored is not None and plan.boundary is not None and plan.tokens is not None and route is not Route.SHARE:
        head = plan.tokens[: plan.boundary]
        marked = await stored.mark(slot, head, prefill=route is Route.PLAIN, req=story.req)
    story.marked(marked)
    keep = Keeping(marked)
    try:
        yield keep
    finally:
        if marked is not None and stored is not None:
            if keep.done:
                stored.keep_marked(marked)
            else:
                stored.discard(marked)
