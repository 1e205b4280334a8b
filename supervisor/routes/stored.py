"""The prefix store's part in a request: restore a stored prefix into the request's slot before the
route is chosen (:meth:`StoredPrefixes.before`), and keep a prompt's state after the reply
(:meth:`~StoredPrefixes.after`, :meth:`~StoredPrefixes.after_hang_up`).

Restoring: ``POST /slots/S?action=restore`` of the entry, exposed under a fresh name in the
decoder's ``--slot-save-path`` (supervisor/prefix/store.py pins it meanwhile).  The slot then holds
the entry's tokens and the decoder (or a hybrid route) prefills only the rest.  A restore the decoder
refuses drops the entry and erases the slot: the request goes on as if there were none.

Keeping: after the last byte of a reply, while the request still holds its slot (no one else may
change its cells), ``POST /slots/S?action=save`` into the state directory; the store's ``put_file``
then moves the file onto its disk off the request's path, in the nursery :meth:`StoredPrefixes.run`
holds.  On every route: after a hybrid route's reply the slot holds the reply's tokens too, which its
handed-over state file lacks.  A stream whose client hung up once the decoder began its reply is kept
the same way, once the decoder reports the slot idle.

A store the hosts share (``cache.shared_dir``) is read again every ``cache.shared_rescan_s`` in the
same nursery, so that a conversation another host served (and drained) restores here.  Before a drain
hands the host over, :meth:`StoredPrefixes.wait_writes` waits for the writes in progress.

Which tokens an entry is for: a prompt's prefix that another recent prompt shared (the system prompt
and tool list a chat's users all send: the part the next request will start with too) when one is
long enough, else the whole prompt (a conversation's next turn starts with it); a chat's up to its
generation prompt, which the next turn may tokenize otherwise with the reply after it.

A model whose state cannot be cut back (a hybrid one: recurrent or convolution layers beside
attention, supervisor/routes/capability.py's ``prefix``) has no use for a slot saved after a reply:
its state holds the reply, and a restore cannot take it back to the prompt.  Its entries end at the
prompt's boundary (routes/prompt.py's ``boundary``: a chat's before its generation prompt), saved
before the rest of the prompt is evaluated (:meth:`StoredPrefixes.mark`): on the plain route the
decoder first prefills up to the boundary alone (``n_predict: 0``), on the file route the slot holds
the boundary as handed over.  The file is committed once the reply is over (:meth:`~StoredPrefixes.keep`)
and removed on every other path (:meth:`~StoredPrefixes.discard`), a cancellation included.  A
stored entry is restored only into a prompt longer than it, and only when it restores exactly.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import attrs
import trio

from ..errors import PrefixStoreError
from ..llama import decoder
from ..llama.slots import PromptKey, SlotPool
from ..prefix.store import Entry, PrefixStore
from .capability import Capability
from .decision import worth_restoring
from .file import SlotClient, erase_slot

log = logging.getLogger("onebit.prefix")
# What a request's story says of the store (a restore it goes on without) is logged with its route.
hybrid_log = logging.getLogger("onebit.hybrid")

# A local save or restore answers in milliseconds; one that takes this long is
# stuck, and the request's slot must not stay held for it.
SAVE_TIMEOUT_S = 30.0
# A branch point kept as an entry ends at a multiple of this many tokens: where two prompts part is
# the shared system prompt plus whatever first words their questions happen to share, so each new
# question would make one more entry a token or a few longer (on the fleet benchmark, 19 of 27 saves
# after a reply were one of 6 system prompts and 1 to 7 tokens more), each a save that holds up the
# decoder's loop.  Rounded down, every question on one system prompt meets the same entry.
BRANCH_TOKENS = 64
# The most tokens an entry kept after a reply leaves out of its prompt, as far as templates go: a
# chat's generation prompt ("<|im_start|>assistant\n", Qwen3's with its empty think block when
# thinking is off, and their like), a raw prompt's last token (routes/boundary.py's entry_end).
GENERATION_PROMPT_MAX = 8
# A chat's generation prompt is the same tokens at every turn of one template and its settings, but
# the text before it may end in a token merged with its first (routes/boundary.py's ``find``): how
# far past the longest generation prompt measured another chat's entry may still end.
SLACK_MARGIN = 2


@attrs.frozen
class Restored:
    entry: Entry | None  # None: nothing restored
    ms: float = 0.0
    why: str = ""  # why a restore failed, for the log


NOTHING = Restored(None)


@attrs.frozen
class Marked:
    """A slot saved at its prompt's boundary (:meth:`StoredPrefixes.mark`), not yet committed."""

    tokens: tuple[int, ...]
    path: Path
    prefilled: decoder.Evaluated | None  # the decoder's prefill up to the boundary, where it made one


class StoredPrefixes:
    """The prefix store as a request meets it; :class:`~supervisor.routes.completion.Completions` calls
    :meth:`before` once the request holds its slot, :meth:`after` (or :meth:`after_hang_up`) while
    it still does.  What it restored goes back to the caller, which writes the route line."""

    def __init__(
        self,
        *,
        client: SlotClient,
        state_dir: Path,
        store: PrefixStore,
        capability: Capability | None = None,
        rescan_s: float = 2.0,
    ) -> None:
        """``capability``: the model's (supervisor/routes/capability.py): where a restored prefix
        cannot spare the decoder a prompt, nothing is restored, saved or kept.  ``rescan_s``: a
        shared store's ``cache.shared_rescan_s``."""
        self._pending_writes = 0
        self.client = client
        self.state_dir = state_dir
        self.store = store
        self.capability = capability
        self.rescan_s = rescan_s
        # The nursery the store's writes run in, off the requests' path: set by run().
        self._writes: trio.Nursery | None = None
        self._writes_done = trio.Event()  # set when the last write in progress ends
        # The most tokens a chat's entry has ended short of its prompt (its generation prompt, as the
        # decoder's template renders it): None until a chat's boundary is found.
        self.chat_slack: int | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the nursery the store's writes run in, for as long as the daemon serves; with a
        shared store, read its directory again every ``rescan_s``."""
        async with trio.open_nursery() as nursery:
            self._writes = nursery
            if self.store.shared:
                nursery.start_soon(self._rescan)
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._writes = None

    async def _rescan(self) -> None:
        while True:
            await trio.sleep(self.rescan_s)
            await self.store.refresh()

    async def wait_writes(self) -> None:
        """Until no write the store was handed is in progress (a drain's hand-over waits for them)."""
        while self._pending_writes:
            self._writes_done = trio.Event()
            await self._writes_done.wait()

    @property
    def writing(self) -> int:
        """The store's writes started and not yet done."""
        return len(self._writes.child_tasks) if self._writes is not None else 0

    @property
    def enabled(self) -> bool:
        """Whether a restored prefix can spare the model's decoder a prompt (its capability)."""
        return self.capability is None or self.capability.store

    def may_hold(self, text: str) -> bool:
        """Whether a prompt of this text may have an entry, or make one: a prompt's text is at least
        as long as its tokens, so a short text cannot."""
        return self.enabled and len(text) >= self.store.min_tokens

    async def before(
        self,
        slot: int,
        key: PromptKey,
        slots: SlotPool,
        *,
        decoder_ms_per_token: float,
        restore_ms: Callable[[int], float],
        req: str,
        prompt_cache: int = 0,
    ) -> Restored:
        """Restore the longest stored prefix of the prompt into the slot, when that spares more
        prefill than it costs (``restore_ms``: of so many bytes of state); ``slots`` then knows what
        the slot holds.  What the decoder would reuse without it counts as spared already: its slot's
        prefix and, with its prompt cache on (``prompt_cache``: its size in tokens), what that cache
        would load from memory (SlotPool.reusable), which costs less than a file from the disk.  Not
        where a state cannot be cut back: a cached prompt that goes on past where this one parts
        spares it nothing there, and only the store holds the state at the boundary."""
        if key.tokens is None or not self.enabled:
            return NOTHING
        # A state that cannot be cut back must leave the decoder a token to compute the logits from.
        entry = await self.store.find(key.tokens[:-1] if self.at_boundary else key.tokens)
        if entry is None:
            return NOTHING
        worth = worth_restoring(
            entry_tokens=entry.n_tokens,
            decoder_cached=slots.reusable(slot, key, prompt_cache=0 if self.at_boundary else prompt_cache),
            decoder_ms_per_token=decoder_ms_per_token,
            restore_ms=restore_ms(entry.state_bytes),
        )
        if not worth:
            return NOTHING
        restored = await self.restore(slot, entry)
        if restored.entry is None:
            if restored.why:
                hybrid_log.warning("prefix store: %s; the request goes on without it (%s)", restored.why, req)
            slots.forget(slot)
        else:
            slots.remember(slot, PromptKey(tokens=entry.tokens))
        return restored

    @property
    def at_boundary(self) -> bool:
        """Entries end at the prompt's boundary, saved before the rest (:meth:`mark`), never after
        a reply (the model's state cannot be cut back)."""
        return self.capability is not None and self.capability.at_boundary

    async def mark(self, slot: int, tokens: tuple[int, ...], *, prefill: bool, req: str) -> Marked | None:
        """For a model whose state cannot be cut back: the slot saved at the prompt's boundary
        (``tokens``, the prompt's first tokens), when the store wants them; ``prefill``: the decoder
        first evaluates them alone (the plain route), else the slot holds them (a handoff's).  The
        caller commits it with :meth:`keep_marked` after the reply, or :meth:`discard` s it."""
        if self._writes is None or not self.enabled or not self.at_boundary or not self.store.wants(tokens):
            return None
        prefilled: decoder.Evaluated | None = None
        if prefill:
            done = await decoder.prefill(self.client, slot, tokens)
            if isinstance(done, decoder.Refusal):
                log.info("prefix store: prefilling slot %d to its boundary answered %s (%s)", slot, done, req)
                return None
            prefilled = done
        path = await self.save(slot, req)
        return None if path is None else Marked(tokens, path, prefilled)

    def keep_marked(self, marked: Marked) -> None:
        """Commit a boundary state :meth:`mark` saved, off the request's path."""
        if self._writes is None:
            self.discard(marked)
            return
        self._start_keep(marked.tokens, marked.path)

    @staticmethod
    def discard(marked: Marked) -> None:
        """Remove a boundary state that is not committed (synchronous: an await here could be
        cancelled and leave the file behind)."""
        marked.path.unlink(missing_ok=True)

    def learn_slack(self, n_tokens: int, ends: int) -> None:
        """A chat of ``n_tokens`` whose messages, rendered without the generation prompt, part from
        it at ``ends`` (its boundary, found by the decoder)."""
        self.chat_slack = max(self.chat_slack or 0, n_tokens - ends)

    def may_keep(self, key: PromptKey, slots: SlotPool, *, restored: Entry | None) -> bool:
        """Whether :meth:`after` may keep anything of a chat's prompt, wherever its entry ends (at the
        boundary the decoder is asked for: two calls to it): False only where it would keep nothing
        at any end within the slack (the longest generation prompt measured on this load, at least
        :data:`GENERATION_PROMPT_MAX`, and :data:`SLACK_MARGIN`).  An agent fleet's question on a
        system prompt already stored is such a chat: what would be kept is that prompt, rounded
        (:meth:`candidate`), and the store holds it; the question itself is no conversation's turn
        (no recent prompt is all of it but its last tokens).  Until one chat's boundary has been
        measured the end is always asked.  Pure."""
        if self._writes is None or key.tokens is None or not self.enabled or self.at_boundary:
            return False
        if restored is not None or self.chat_slack is None:
            return True  # kept whole up to its end, or no generation prompt measured: where it ends matters
        slack = max(self.chat_slack, GENERATION_PROMPT_MAX) + SLACK_MARGIN
        # Whether the prompt extends a recent one grows with the slack: at the most slack it does not.
        shared, extends = slots.shared(key, slack=slack)
        if extends or shared < self.store.min_tokens or shared > len(key.tokens) - slack:
            return True
        return self.candidate(key.tokens, shared, extends) is not None

    async def after(
        self,
        slot: int,
        key: PromptKey,
        slots: SlotPool,
        *,
        req: str,
        restored: Entry | None,
        ends: int | None = None,
        settle: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Save a request's slot for the store, after its reply, when it holds a prompt worth keeping
        (never where a state cannot be cut back: its entry was saved at the boundary, :meth:`mark`).
        ``ends``: how many of the prompt's tokens its entry may hold at most (a chat's, up to its
        boundary: routes/boundary.py's ``entry_end``).  ``settle``: awaited before the save, the slot
        kept meanwhile (routes/completion.py's: until the decoder's prefills in flight are answered;
        the save, on the decoder's loop, would hold them back)."""
        if self._writes is None or key.tokens is None or not self.enabled or self.at_boundary:
            return
        # A chat's next turn matches it up to its generation prompt (``ends``), not always past it.
        shared, extends = slots.shared(key, slack=len(key.tokens) - ends if ends is not None else 0)
        if restored is not None:
            # It went on from a stored prefix, as a conversation's next turn goes on from the last:
            # kept whole, the next turn finds all of it (the store makes one entry of repeats).
            shared, extends = restored.n_tokens, True
        tokens = self.candidate(key.tokens[:ends] if ends is not None else key.tokens, shared, extends)
        if tokens is None:
            return
        slots.keeping(slot, key)  # a next turn sent at once waits for this slot, not a cold one
        if settle is not None:
            await settle()
        path = await self.save(slot, req)
        if path is None:
            return
        if self._writes is None:
            path.unlink(missing_ok=True)
            return
        self._start_keep(tokens, path)

    async def after_hang_up(
        self,
        slot: int,
        key: PromptKey,
        slots: SlotPool,
        *,
        req: str,
        restored: Entry | None,
        settle: Callable[[int], Awaitable[None]],
        ready: Callable[[], bool],
    ) -> None:
        """Save a slot its client left mid-stream: once the decoder has stopped in it (``settle``: it
        notices the closed connection at its next token), while the request still holds it, if the
        decoder is still ``ready``.  Shielded from the cancellation that brought us here; bounded by
        the settle's and the save's own timeouts."""
        with trio.CancelScope(shield=True):
            if key.tokens is None or not self.enabled or self.at_boundary:
                return
            await settle(slot)
            if ready():
                await self.after(slot, key, slots, req=req, restored=restored)

    async def restore(self, slot: int, entry: Entry) -> Restored:
        started = trio.current_time()
        try:
            async with self.store.exposed(entry, self.state_dir) as name:
                # The slot may hold more than the entry: a saved reply's tokens after its prefix,
                # except where a state cannot be cut back (it must hold the entry exactly).
                more = not self.at_boundary
                refused = await decoder.restore(self.client, slot, name, entry.n_tokens, more=more)
        except PrefixStoreError as exc:
            return Restored(None, why=str(exc))
        ms = (trio.current_time() - started) * 1000
        if refused is None:
            self.store.record_restore(ms, entry)
            return Restored(entry, ms)
        self.store.drop(entry, reason=refused.what)
        await erase_slot(self.client, slot, "a refused prefix-store restore")
        return Restored(None, ms, refused.what)

    def unused(self, entry: Entry, cache_n: int | None) -> bool:
        """The decoder's ``cache_n`` after a restored request says whether it used the entry; an
        entry it did not use is dropped (it would only cost again)."""
        if cache_n is None or cache_n >= entry.n_tokens - 1:
            return False
        self.store.drop(entry, reason=f"the decoder reused {cache_n} of its {entry.n_tokens} tokens")
        return True

    def candidate(self, tokens: Sequence[int], shared: int, extends: bool) -> tuple[int, ...] | None:
        """The tokens worth an entry for this prompt, or None.  ``shared``: the longest prefix a
        recent prompt had in common with it; ``extends``: that was all of the recent prompt.

        A prompt that extends a recent one (a conversation's next turn) or shares nothing long is
        kept whole: the next turn starts with it.  One that branches off a long shared prefix (the
        same system prompt, another question) keeps only that prefix: the next request will share
        it too, not this one's question: up to a multiple of :data:`BRANCH_TOKENS`."""
        if shared >= self.store.min_tokens and not extends:
            prefix = tuple(tokens[: shared - shared % BRANCH_TOKENS])
            return prefix if self.store.wants(prefix) else None
        return tuple(tokens) if self.store.wants(tokens) else None

    async def save(self, slot: int, req: str) -> Path | None:
        """Save the slot into the state directory (shielded, bounded): the file, or None."""
        path = self.state_dir / f"{req}-{secrets.token_hex(4)}.keep"
        with trio.CancelScope(shield=True), trio.move_on_after(SAVE_TIMEOUT_S):
            saved = await decoder.save(self.client, slot, path.name)
            if isinstance(saved, decoder.Saved):
                return path
            log.info("prefix store: saving slot %d answered %s: %s", slot, saved.status, saved.words)
        path.unlink(missing_ok=True)
        return None

    def _start_keep(self, tokens: Sequence[int], path: Path) -> None:
        """Hand the file to the store off the request's path, counted as in progress from now: a
        drain's :meth:`wait_writes` that comes before the write's task has run still waits for it
        (else it would find nothing in progress, and the drain would save the slot whole again)."""
        assert self._writes is not None
        self._pending_writes += 1
        self._writes.start_soon(self._keep, tokens, path)

    async def _keep(self, tokens: Sequence[int], path: Path) -> None:
        """The store takes the file (and always consumes it)."""
        try:
            await self.store.put_file(tokens, path)
        finally:
            self._pending_writes -= 1
            if not self._pending_writes:
                self._writes_done.set()
