"""The slots of a llama-server (the decoder's, or a llama-server provider's), owned by onebitd.

Every request is pinned to a slot we handed out (``id_slot``), so a hybrid route can restore a
prompt's state into a slot that nobody else will take.  Waiters queue in arrival order (trio's
Semaphore is FIFO); past ``queue_limit`` waiters a request is refused at once with 503.

Which free slot a request gets: the one whose last prompt shares the longest prefix with its own
(llama-server reuses that prefix from the slot's cache: a chat's next turn evaluates only what is
new), else the least recently used one, so warm prefixes live longest.  A prompt is known by its
tokens where onebitd tokenized it, else by its text (the prompt, or the chat's messages as JSON),
which is free and follows the tokens closely enough to keep a conversation on its slot.

What a request pinned to a slot reuses (:meth:`SlotPool.reusable`): the slot's prefix, and, with
llama-server's own prompt cache on (``--cache-ram``), whatever that cache holds.  llama-server saves
its idle slots there as each task starts, and a slot that would keep less than half of what it
holds is saved there before the best match is loaded into it (server-context.cpp's
``get_available_slot``, server-task.cpp's ``server_prompt_cache::load``): a prompt a slot held
stays reusable after the slot moves on, until the cache's memory bound pushes it out or a slot
loads it (the cache gives up what it loads: :meth:`SlotPool.loads`).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import attrs
import trio

from ..config import source
from ..errors import Overloaded

# A shared prefix shorter than this says nothing about a conversation (every chat starts with the
# same template tokens, every chat's JSON with the same characters): below it, the LRU slot is taken.
USEFUL_TOKENS = 16
USEFUL_CHARS = 64
# How long a request waits for a slot that is only being saved (the chat's end asked, then the prefix
# store's save after a reply, bounded at 30 s in routes/stored.py): past that it takes a free one.
KEEP_WAIT_S = 35.0
# The prompts slots held before they moved on, kept for llama-server's prompt cache: newest first,
# as many as the cache's size in tokens allows (reusable's ``prompt_cache``), never more than this
# many (1 GiB holds about 55 prompts of 800 tokens of SmolLM2-135M's 22.5 KiB a token; a larger
# model holds fewer).
SAVED_PROMPTS = 64
# llama-server loads a cached prompt only where the request keeps a quarter of it or more
# (server_prompt_cache::load: "don't trash large prompts").
CACHE_KEEP = 0.25


@attrs.frozen
class PromptKey:
    """What a slot is asked to hold: the prompt's text, and its tokens when they are known."""

    text: str = ""
    tokens: tuple[int, ...] | None = None


def common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    """The length of the prefix ``a`` and ``b`` share.

    By slice comparisons (each one a C-level compare), not element by element: a request compares
    its prompt with every free slot's, and with the prompts llama-server's cache holds, before it
    reaches the decoder, and a Python loop over a long chat's tokens costs milliseconds of that
    request's first token.  Blocks that double from the front while they match, then bisection in
    the block that differs: the cost follows the shared prefix, not the sequences' length (two
    unrelated 30k-token prompts part within the first block)."""
    n = min(len(a), len(b))
    low, step = 0, 64
    while True:
        high = min(n, low + step)
        if a[low:high] != b[low:high]:
            break
        if high == n:
            return n
        low, step = high, 2 * step
    # Invariant: a[:low] == b[:low] and a[low:high] != b[low:high].
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low


def shared(held: PromptKey, wanted: PromptKey) -> tuple[int, bool]:
    """How much of ``wanted`` the slot holding ``held`` has, and whether that counts as a match."""
    if held.tokens is not None and wanted.tokens is not None:
        n = common_prefix(held.tokens, wanted.tokens)
        return n, n >= min(USEFUL_TOKENS, len(wanted.tokens))
    n = common_prefix(held.text, wanted.text)
    return n, n > 0 and n >= min(USEFUL_CHARS, len(wanted.text))


@attrs.frozen
class SlotHolding:
    """One slot: ``free``, ``busy`` (a request holds it), or ``kept`` (its request has answered and
    holds on only to save it to the prefix store); ``tokens``: the prompt tokens its cache holds, as
    far as onebitd knows (None: not known).  A count, never the tokens."""

    slot: int
    state: str
    tokens: int | None


@attrs.frozen
class SlotStatistics:
    total: int
    busy: int
    free: int
    queued: int
    queue_limit: int
    # Slots handed out to the free slot whose prompt matched, and to the least recently used one.
    affinity_hits: int = 0
    affinity_misses: int = 0
    # Requests that waited for their conversation's slot while it was being saved, and those waiting now.
    keep_waits: int = 0
    keep_waiting: int = 0
    each: tuple[SlotHolding, ...] = ()  # slot by slot (several models' pools merged: none; see each model's)


class SlotPool:
    def __init__(self, n_slots: int, queue_limit: int | Callable[[], int]) -> None:
        """``queue_limit``: a number, or where to read it at each request (``server.queue_limit``,
        which a reload changes: waiters already queued stay queued)."""
        self.n_slots = n_slots
        self._queue_limit = source(queue_limit)
        self._semaphore = trio.Semaphore(n_slots)
        self._free = set(range(n_slots))
        self._held = [PromptKey() for _ in range(n_slots)]
        # What llama-server's prompt cache holds beside the slots, as far as onebitd knows: newest last.
        self._saved: deque[tuple[int, ...]] = deque(maxlen=SAVED_PROMPTS)
        self._tick = itertools.count(1)
        self._used = [0] * n_slots  # when each slot was last handed out, in hand-outs
        self._hits = 0
        self._misses = 0
        # Slots whose request has answered and holds on only to save the slot: what each will hold.
        self._keeping: dict[int, tuple[PromptKey, trio.Event]] = {}
        self._keep_waits = 0
        self._keep_waiting = 0
        # What each held slot will hold once its request lets go (hold's key, or what will_hold said).
        self._will_hold: dict[int, PromptKey | None] = {}

    @property
    def queue_limit(self) -> int:
        return self._queue_limit()

    def statistics(self) -> SlotStatistics:
        return SlotStatistics(
            total=self.n_slots,
            busy=self.n_slots - len(self._free),
            free=len(self._free),
            queued=self._semaphore.statistics().tasks_waiting,
            queue_limit=self.queue_limit,
            affinity_hits=self._hits,
            affinity_misses=self._misses,
            keep_waits=self._keep_waits,
            keep_waiting=self._keep_waiting,
            each=tuple(self._holding(slot) for slot in range(self.n_slots)),
        )

    def _holding(self, slot: int) -> SlotHolding:
        state = "kept" if slot in self._keeping else "free" if slot in self._free else "busy"
        tokens = self._held[slot].tokens
        return SlotHolding(slot, state, None if tokens is None else len(tokens))

    def holds(self, slot: int) -> PromptKey:
        """The prompt the slot was last given (what its cache holds, as far as we know)."""
        return self._held[slot]

    def cached(self, slot: int, key: PromptKey) -> int:
        """Tokens of ``key`` the slot holds as a prefix (0 when the tokens are not known)."""
        held = self._held[slot]
        if held.tokens is None or key.tokens is None:
            return 0
        return common_prefix(held.tokens, key.tokens)

    def best_cached(self, key: PromptKey) -> int:
        """The most tokens of ``key`` any free slot holds: what a job would find if it came now."""
        return max((self.cached(slot, key) for slot in self._free), default=0)

    def reusable(self, slot: int, key: PromptKey, *, prompt_cache: int) -> int:
        """Tokens of ``key`` llama-server would reuse with the request pinned to ``slot``: the
        slot's prefix; with its prompt cache on and the slot keeping less than half of what it
        holds, the longest prefix that cache holds (any free slot's, and the prompts slots held
        before, the newest ``prompt_cache`` tokens of them: the cache's size in tokens, 0 off), which
        llama-server then loads into the slot (server_context's get_available_slot; :meth:`loads`)."""
        own = self.cached(slot, key)
        consulted = self._consults_cache(slot, own, key, prompt_cache)
        if consulted is None:
            return own
        best, (_, asked) = max(own, self.best_cached(key)), consulted
        for index in self._cache_window(prompt_cache):
            tokens = self._saved[index]
            n = common_prefix(tokens, asked)
            if n >= CACHE_KEEP * len(tokens):
                best = max(best, n)
        return best

    def _consults_cache(
        self, slot: int, own: int, key: PromptKey, prompt_cache: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """What the slot holds and ``key``'s tokens, where llama-server consults its prompt cache for
        ``key`` in ``slot``, keeping ``own`` of it: the cache on, the slot keeping less than half
        (an empty slot keeps 0/0, never less); else None."""
        held = self._held[slot].tokens
        if prompt_cache <= 0 or key.tokens is None or not held or 2 * own >= len(held):
            return None
        return held, key.tokens

    def _cache_window(self, prompt_cache: int) -> list[int]:
        """The places in ``_saved`` of the prompts the cache still holds, newest first: as many as
        ``prompt_cache`` tokens hold (llama-server drops the oldest past its size)."""
        window, room = [], prompt_cache
        for index in range(len(self._saved) - 1, -1, -1):
            room -= len(self._saved[index])
            if room < 0:
                break
            window.append(index)
        return window

    def loads(self, slot: int, key: PromptKey, *, prompt_cache: int) -> None:
        """``key``'s prompt is sent to ``slot`` for the decoder to evaluate: where llama-server
        consults its prompt cache, it first saves the slot there, then loads the best match and
        takes it out of the cache (server_prompt_cache::load), so a request on the same prefix
        pinned to another slot meanwhile evaluates all of it (the fleet's ask 58).  The match is
        llama-server's: oldest first, a quarter kept at least, each better at both shares."""
        own = self.cached(slot, key)
        consulted = self._consults_cache(slot, own, key, prompt_cache)
        if consulted is None:
            return
        held, asked = consulted
        self._save(held)  # saved first (server_context's get_available_slot): a request beside it may load it
        keep, share, best = own / len(held), own / len(asked), None
        for index in reversed(self._cache_window(prompt_cache)):  # oldest first, as llama-server walks it
            tokens = self._saved[index]
            n = common_prefix(tokens, asked)
            if n >= CACHE_KEEP * len(tokens) and n / len(tokens) > keep and n / len(asked) > share:
                keep, share, best = n / len(tokens), n / len(asked), index
        if best is not None:
            del self._saved[best]

    def _moves_on(self, slot: int, key: PromptKey) -> None:
        """The slot holds ``key`` now; what it held before stays in llama-server's prompt cache."""
        before = self._held[slot].tokens
        self._held[slot] = key
        if not before or (key.tokens is not None and common_prefix(before, key.tokens) == len(before)):
            return  # nothing, or a prefix of what the slot holds now
        self._save(before)

    def _save(self, tokens: tuple[int, ...]) -> None:
        """llama-server's prompt cache takes ``tokens`` (server_prompt_cache::alloc): not where it
        holds them already, within a longer prompt; the prompts they contain go."""
        if any(common_prefix(tokens, saved) == len(tokens) for saved in self._saved):
            return
        kept = [saved for saved in self._saved if common_prefix(saved, tokens) < len(saved)]
        self._saved.clear()
        self._saved.extend([*kept, tokens])

    def forget(self, slot: int) -> None:
        """The slot was erased: it holds nothing."""
        self._moves_on(slot, PromptKey())

    def forget_all(self) -> None:
        """The server restarted: its slots and its prompt cache hold nothing."""
        self._held = [PromptKey() for _ in range(self.n_slots)]
        self._saved.clear()

    def remember(self, slot: int, key: PromptKey) -> None:
        """The slot holds ``key`` now (a stored prefix was restored into it)."""
        self._moves_on(slot, key)

    def shared(self, key: PromptKey, slack: int = 0) -> tuple[int, bool]:
        """The longest token prefix ``key`` shares with a recent prompt (what a slot holds, or held
        before it moved on), and whether it is all of that prompt (``key`` extends it: a
        conversation's next turn) rather than a branch point (a system prompt, a tool list that
        other prompts start with too); ``slack``: but for so many of its last tokens (a chat's
        generation prompt, which its next turn re-renders).  The prompts slots held before count:
        an agent fleet's groups outnumber the slots, and a question on a system prompt no slot holds
        now is still a branch off the questions asked on it before, not a new conversation."""
        best, extends = 0, False
        if key.tokens is None:
            return best, extends
        recent = [held.tokens for held in self._held if held.tokens]
        for tokens in (*recent, *reversed(self._saved)):
            n = common_prefix(tokens, key.tokens)
            if n > best:
                best, extends = n, n >= len(tokens) - slack
        return best, extends

    def keeping(self, slot: int, key: PromptKey) -> None:
        """The request holding ``slot`` has sent its last byte and holds on only to save the slot
        (routes/stored.py), or to tokenize a prompt it sent before it was planned
        (routes/completion.py): until it lets go, a request that continues ``key`` (a conversation's next
        turn, sent the moment the reply ended) waits for this slot rather than take a cold free one.
        llama-server reached directly has no such gap: it saves between two tasks of its own.
        Told again, only the key changes (a request waiting for the slot stays woken by its release)."""
        kept = self._keeping.get(slot)
        self._keeping[slot] = (key, trio.Event() if kept is None else kept[1])

    def _kept_for(self, key: PromptKey) -> trio.Event | None:
        """The release of the slot being saved that holds more of ``key`` than every free slot."""
        if not self._keeping:
            return None
        best_free = 0
        for slot in self._free:
            n, useful = shared(self._held[slot], key)
            if useful:
                best_free = max(best_free, n)
        wanted: trio.Event | None = None
        best = best_free
        for kept, event in self._keeping.values():
            n, useful = shared(kept, key)
            if useful and n > best:
                wanted, best = event, n
        return wanted

    async def _wait_for_kept(self, key: PromptKey) -> None:
        """Wait (bounded) for a slot being saved when it holds more of ``key`` than every free slot."""
        wanted = self._kept_for(key)
        if wanted is None:
            return
        self._keep_waits += 1
        self._keep_waiting += 1
        try:
            with trio.move_on_after(KEEP_WAIT_S):
                await wanted.wait()
        finally:
            self._keep_waiting -= 1

    def _best(self, key: PromptKey | None) -> tuple[int, int]:
        """The free slot for ``key`` and how much of it that slot holds: the longest useful match,
        else the least recently used slot (0)."""
        lru = min(self._free, key=lambda s: self._used[s])
        if key is None:
            return lru, 0
        best, best_n = lru, 0
        for slot in sorted(self._free, key=lambda s: self._used[s]):
            n, useful = shared(self._held[slot], key)
            if useful and n > best_n:
                best, best_n = slot, n
        return best, best_n

    def _pick(self, key: PromptKey | None) -> int:
        best, best_n = self._best(key)
        if key is not None and best_n:
            self._hits += 1
        elif key is not None:
            self._misses += 1
        return best

    def peek(self, key: PromptKey) -> int | None:
        """The slot :meth:`hold` would give ``key`` now, where one is free with no request queued
        and no slot being saved that ``key`` would wait for: None otherwise.  Nothing is taken: a
        caller that then holds a slot checks it got this one."""
        # A slot freed with a request queued is that request's already (trio hands the permit over).
        if not self._semaphore.value or self._semaphore.statistics().tasks_waiting or self._kept_for(key) is not None:
            return None
        return self._best(key)[0]

    def will_hold(self, slot: int, key: PromptKey | None) -> None:
        """The held ``slot`` will hold ``key`` once its request lets go, in place of the key it was
        held for (a prompt held by its text, tokenized since); None: what it held before."""
        if slot in self._will_hold:
            self._will_hold[slot] = key

    @asynccontextmanager
    async def hold(
        self, key: PromptKey | None = None, *, settle: Callable[[int], Awaitable[None]] | None = None
    ) -> AsyncIterator[int]:
        """Wait for a free slot, in arrival order, and hold it for the block; the slot is then
        taken to hold ``key``'s prompt.  A block left by an exception (its client hung up, most
        often) first awaits ``settle(slot)``: the server may still be working in that slot, and the
        next request must not be pinned behind that work.  ``settle`` shields itself, bounded."""
        if self._semaphore.value == 0 and self._semaphore.statistics().tasks_waiting >= self.queue_limit:
            raise Overloaded()
        if key is not None:
            await self._wait_for_kept(key)
        await self._semaphore.acquire()
        slot = self._pick(key)
        self._free.discard(slot)
        self._used[slot] = next(self._tick)
        self._will_hold[slot] = key
        try:
            yield slot
        except BaseException:
            if settle is not None:
                await settle(slot)
            raise
        finally:
            held = self._will_hold.pop(slot, None)
            if held is not None:
                self._moves_on(slot, held)
            self._free.add(slot)
            self._semaphore.release()
            kept = self._keeping.pop(slot, None)
            if kept is not None:
                kept[1].set()
