"""The file route's effects: a provider prefills into a state file, the decoder restores it.

``FileHandoff.run`` returns an :class:`~supervisor.routes.decision.Outcome`: ``ok`` when the decoder
slot holds the prompt's KV, else the step that failed (the provider's prefill, or the restore), the
reason and the words for the log, with the slot erased when a restore was attempted.  It logs nothing
and writes no route line: ``Completions`` does both.  The state file is removed as soon as the
restore answered, and on every other path, cancellation included.
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from pathlib import Path

import attrs
import trio

from ..llama import decoder
from ..llama.decoder import JsonClient
from ..providers import PrefillJob, Provider
from ..reasons import Reason
from .capability import Capability
from .decision import Outcome, Route, Step
from .prefill import prefill

log = logging.getLogger("onebit.hybrid")

# Abandoned state files removed again by later handoffs: more jobs than are ever in flight at once.
ABANDONED_KEPT = 256


# The part of the decoder the handoffs use (DecoderClient; a fake in tests).
SlotClient = JsonClient


async def erase_slot(client: SlotClient, slot: int, after: str) -> None:
    """Empty a decoder slot a handoff left cells in, sent twice if need be (llama/decoder.py's
    ``erase``); a failure is logged, not raised (the request still goes on, and the decoder
    re-evaluates a prompt whose cells it does not trust)."""
    refused = await decoder.erase(client, slot, tries=2)
    if refused is not None and refused.status == 0:
        log.warning("hybrid: erasing slot %d after %s failed: %s", slot, after, refused.words)


class FileHandoff:
    def __init__(
        self, *, client: SlotClient, state_dir: Path, model: str, n_ctx: int, capability: Capability | None = None
    ) -> None:
        """``capability``: the model's (supervisor/routes/capability.py): where only a state saved a
        token short restores usably, the provider prefills the prompt less its last token."""
        self.client = client
        self.capability = capability
        self.state_dir = state_dir
        self.model = model
        self.n_ctx = n_ctx
        # State files of jobs we gave up on (cancelled, timed out, failed): a provider that was
        # stopped or slow may still write one after we removed it, so each later handoff removes
        # them again.  The last ABANDONED_KEPT are remembered.
        self._abandoned: deque[Path] = deque(maxlen=ABANDONED_KEPT)

    def sweep(self) -> None:
        """Remove whatever abandoned jobs wrote late (synchronous: unlinks of local files)."""
        for path in self._abandoned:
            path.unlink(missing_ok=True)

    def state_file(self, req: str) -> Path:
        # Our name, never the client's; random so a retried request id cannot collide.
        return self.state_dir / f"{req}-{secrets.token_hex(4)}.state"

    async def run(
        self, *, req: str, slot: int, tokens: list[int], provider: Provider, timeout_s: float, end: int | None = None
    ) -> Outcome:
        """``end``: where the state handed over of a model that cannot cut its state back ends (the
        prompt's boundary, routes/prompt.py), when known; else the capability's ``short_by``."""
        path = self.state_file(req)
        self.sweep()
        handed_over = False
        if self.capability is not None:
            tokens = self.capability.handed_over(tokens, end)
        try:
            job = PrefillJob(req, self.model, self.n_ctx, tuple(tokens), path)
            done = await prefill(provider, job, timeout_s=timeout_s)
            state_bytes = _size(path) if done.reason is None else None
            if state_bytes is None:
                reason, why = done.reason, done.why
                if reason is None:
                    reason, why = Reason.PROVIDER_FAILED, f"provider {provider.name} wrote no state file"
                return Outcome(
                    Route.FILE, Step.FILE_PREFILL, reason, why, prefill_ms=done.prefill_ms, answered=done.answered
                )
            restored = await self._restore(slot, path, len(tokens), done.prefill_ms)
            if not restored.ok:
                return restored
            saving_ms = max(0.0, done.wall_ms - (done.prefill_ms or 0.0))
            handed_over = True
            return attrs.evolve(
                restored,
                evaluated=done.evaluated,
                state_bytes=state_bytes,
                handoff_ms=saving_ms + (restored.restore_ms or 0.0),
            )
        finally:
            path.unlink(missing_ok=True)
            if not handed_over:
                self._abandoned.append(path)

    async def _restore(self, slot: int, path: Path, expected: int, prefill_ms: float | None) -> Outcome:
        started = trio.current_time()
        try:
            refused = await decoder.restore(self.client, slot, path.name, expected)
        finally:
            restore_ms = (trio.current_time() - started) * 1000
            # Synchronous on purpose: an await here could be cancelled and leave the file behind.
            path.unlink(missing_ok=True)  # noqa: ASYNC240
        if refused is None:
            return Outcome(Route.FILE, prefill_ms=prefill_ms, restore_ms=restore_ms)
        # A half-restored slot must not leak its cells into the plain request that follows.
        await erase_slot(self.client, slot, "a refused restore")
        return Outcome(
            Route.FILE,
            Step.RESTORE,
            Reason.RESTORE_REFUSED,
            str(refused),
            prefill_ms=prefill_ms,
            restore_ms=restore_ms,
        )


def _size(path: Path) -> int | None:
    """The state file's size; None when the provider wrote none.  A stat of a local file,
    synchronously: a worker thread here would be a checkpoint that lets the clock run (and costs
    more than the stat)."""
    try:
        return path.stat().st_size
    except OSError:
        return None
