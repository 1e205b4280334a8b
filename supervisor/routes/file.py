"""The file route's effects: a provider prefills into a state file, the decoder restores it.

``FileHandoff.run`` either leaves the prompt's KV in the decoder slot and returns True, or cleans up
(the file removed, the slot erased when a restore was attempted), says why once in the log and in the
route line's ``fallback``, and returns False: the request then goes plain.  The state file is removed
as soon as the restore answered, and on every other path, cancellation included.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import Any, Protocol

import trio

from ..errors import DecoderError, ProviderError
from ..providers import PrefillJob, Provider
from ..routeline import RouteLine
from .decision import Reason, claim_matches

log = logging.getLogger("onebit.hybrid")


class SlotClient(Protocol):
    """The part of the decoder the handoff uses (DecoderClient; a fake in tests)."""

    async def post_json(self, path: str, body: Any) -> tuple[int, Any]: ...


async def erase_slot(client: SlotClient, slot: int, after: str) -> None:
    """Empty a decoder slot a handoff left cells in.  Erasing is idempotent, so a pooled connection
    the decoder closed under us is worth one retry; a failure is logged, not raised (the request
    still goes on, and the decoder re-evaluates a prompt whose cells it does not trust)."""
    for attempt in (1, 2):
        try:
            await client.post_json(f"/slots/{slot}?action=erase", {})
            return
        except DecoderError as exc:
            if attempt == 2:
                log.warning("hybrid: erasing slot %d after %s failed: %s", slot, after, exc.message)


class FileHandoff:
    def __init__(
        self,
        *,
        client: SlotClient,
        state_dir: Path,
        model: str,
        n_ctx: int,
        prefill_timeout_s: float,
    ) -> None:
        self.client = client
        self.state_dir = state_dir
        self.model = model
        self.n_ctx = n_ctx
        self.prefill_timeout_s = prefill_timeout_s

    def state_file(self, req: str) -> Path:
        # Our name, never the client's; random so a retried request id cannot collide.
        return self.state_dir / f"{req}-{secrets.token_hex(4)}.state"

    async def run(self, *, req: str, slot: int, tokens: list[int], provider: Provider, line: RouteLine) -> bool:
        path = self.state_file(req)
        expected = len(tokens)
        try:
            job = PrefillJob(req, self.model, self.n_ctx, tuple(tokens), path)
            started = trio.current_time()
            try:
                with trio.fail_after(self.prefill_timeout_s):
                    claim = await provider.prefill(job)
            except trio.TooSlowError:
                return self._fall_back(
                    line,
                    Reason.PROVIDER_FAILED,
                    f"provider {provider.name} took over {self.prefill_timeout_s:g}s",
                )
            except ProviderError as exc:
                return self._fall_back(line, Reason.PROVIDER_FAILED, f"provider failed: {exc}")
            measured_ms = (trio.current_time() - started) * 1000
            # The provider's own number, so both hybrid routes report the same figure for the same work.
            line.prefill_ms = claim.prefill_ms if claim.prefill_ms is not None else measured_ms
            if not claim_matches(claim.n_tokens, expected):
                return self._fall_back(
                    line, Reason.SHORT_CLAIM, f"provider prefilled {claim.n_tokens} of {expected} tokens"
                )
            # A stat of a local file, synchronously: a worker thread here would be a checkpoint that
            # lets the clock run (and costs more than the stat).
            if not path.is_file():
                return self._fall_back(line, Reason.PROVIDER_FAILED, f"provider {provider.name} wrote no state file")
            return await self._restore(slot, path, expected, line)
        finally:
            path.unlink(missing_ok=True)

    async def _restore(self, slot: int, path: Path, expected: int, line: RouteLine) -> bool:
        started = trio.current_time()
        try:
            status, data = await self.client.post_json(f"/slots/{slot}?action=restore", {"filename": path.name})
        except DecoderError as exc:
            status, data = 0, {"error": {"message": exc.message}}
        finally:
            line.restore_ms = (trio.current_time() - started) * 1000
            # Synchronous on purpose: an await here could be cancelled and leave the file behind.
            path.unlink(missing_ok=True)  # noqa: ASYNC240
        n_restored = data.get("n_restored") if isinstance(data, dict) else None
        if status == 200 and n_restored == expected:
            return True
        await self._erase(slot)
        what = f"restore answered {status}" if status != 200 else f"restored {n_restored} of {expected} tokens"
        return self._fall_back(line, Reason.RESTORE_REFUSED, f"{what}: {_message(data)}")

    async def _erase(self, slot: int) -> None:
        # A half-restored slot must not leak its cells into the plain request that follows.
        await erase_slot(self.client, slot, "a refused restore")

    @staticmethod
    def _fall_back(line: RouteLine, reason: Reason, why: str) -> bool:
        log.warning("hybrid: %s; the backend prefills this request itself", why)
        line.fallback = reason.value
        return False


def _message(data: object) -> str:
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))
    return str(data)[:300]
