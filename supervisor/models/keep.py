"""The slots a model keeps before it goes: before an unload or at a drain's end, each slot whose
prompt the prefix store would keep (and does not hold yet) is saved into it, awaited, so that the
conversation restores from the store when its model is back, or on another host (instead of
prefilling again)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..llama.slots import SlotPool
from ..routes.stored import GENERATION_PROMPT_MAX, StoredPrefixes

log = logging.getLogger("onebit.model")


async def keep_slots(
    slots: SlotPool, stored: StoredPrefixes, name: str, go_on: Callable[[], bool] = lambda: True
) -> int:
    """Model ``name``'s slots kept in ``stored``; how many it saved.  No request holds a slot now
    (the scheduler unloads only an unused model; a drain waits for its in-flight requests first, and
    ``go_on`` says before each slot that it still drains: a resume lets requests in again).  None
    where a state cannot be cut back (a hybrid model's): a slot holds its reply too, and each request
    kept its prompt's boundary already (supervisor/routes/boundary.py)."""
    if not stored.enabled or stored.at_boundary:
        return 0
    kept = 0
    for slot in range(slots.n_slots):
        if not go_on():
            break
        tokens = slots.holds(slot).tokens
        if not tokens or not stored.store.wants(tokens) or _kept_after_reply(stored, tokens):
            continue
        path = await stored.save(slot, f"unload-{name}-{slot}")
        if path is not None and await stored.store.put_file(tokens, path):
            kept += 1
    if kept:
        log.info("model %s: %d slot(s) kept in the prefix store", name, kept)
    return kept


def _kept_after_reply(stored: StoredPrefixes, tokens: tuple[int, ...]) -> bool:
    """The store holds the slot's prompt up to where its next turn matches it (its entry after the
    reply): the whole prompt again would be a file the next turn cannot use (its last tokens may
    tokenize otherwise once the reply follows them).  A branch that parted earlier is still kept."""
    found = stored.store.peek(tokens)
    return found is not None and len(tokens) - found.n_tokens <= GENERATION_PROMPT_MAX
