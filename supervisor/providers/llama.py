"""The ``llama-server`` provider: a second llama-server used only for prefill.

It runs the same model with the same ``-c``/``-np``/batch/cache parameters as the decoder (both
command lines come from the one [model] section) and saves into the decoder's ``--slot-save-path``,
so the state file it writes is one the decoder's restore accepts.  A job is
``POST /completion {"prompt": tokens, "n_predict": 0, "id_slot": k}`` then
``POST /slots/k?action=save {"filename": <name>}``; cancelling it closes that request.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import trio

from ..child import Child, ChildState
from ..config import Config
from ..config import LlamaServerProvider as LlamaServerProviderConfig
from ..decoder import DecoderClient
from ..errors import DecoderError, ProviderError
from ..llama_server import LlamaServerLauncher, connection_limit
from ..share_worker import Refused, write_saved_state
from ..slots import PromptKey, SlotPool
from .base import Claim, Job, JobCounts, PrefillJob, ProviderStatistics, ShareJob


class LlamaServerProvider:
    kind = "llama-server"
    # A share job: it prefills into its own cache, saves the slot, and copies each position's K/V rows
    # from the saved file into the decoder's lent region (supervisor/share_worker.py's format).
    supports_share = True

    def __init__(self, spec: LlamaServerProviderConfig, config: Config, *, runtime_dir: Path, state_dir: Path) -> None:
        self.name = spec.name
        self.state_dir = state_dir
        self.launcher = LlamaServerLauncher(
            f"provider-{spec.name}",
            config,
            binary=spec.binary or config.decoder.binary,
            client=DecoderClient(
                runtime_dir / f"provider-{spec.name}.sock", max_connections=connection_limit(config.model.parallel)
            ),
            slot_save_path=state_dir,
            threads=spec.threads,
            extra_args=spec.extra_args,
        )
        self.child = Child(self.launcher, spec.health, spec.restart, cpu_affinity=spec.cpu_affinity)
        # Its own slots, as many as the decoder's (-np is shared); jobs beyond that wait their turn.
        self.slots = SlotPool(config.model.parallel, queue_limit=1 << 16)
        self.counts = JobCounts()

    @property
    def ready(self) -> bool:
        return self.child.state is ChildState.READY

    @property
    def busy(self) -> int:
        return self.counts.busy

    async def run(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self.child.run(task_status=task_status)
        finally:
            with trio.CancelScope(shield=True):
                await self.launcher.client.aclose()

    def cached_tokens(self, tokens: tuple[int, ...]) -> int:
        return self.slots.best_cached(PromptKey(tokens=tokens))

    async def prefill(self, job: Job) -> Claim:
        if isinstance(job, ShareJob):
            with self.counts.track():
                async with self.slots.hold(PromptKey(tokens=job.tokens)) as slot:
                    return await self._share_in(slot, job)
        if job.state_file.parent != self.state_dir:
            raise ProviderError(f"{self.name}: state file {job.state_file} is outside {self.state_dir}")
        with self.counts.track():
            # Its slots keep their prompts too: a chat's next turn lands where its prefix is.
            async with self.slots.hold(PromptKey(tokens=job.tokens)) as slot:
                return await self._prefill_in(slot, job)

    async def _prefill_in(self, slot: int, job: PrefillJob) -> Claim:
        client = self.launcher.client
        try:
            status, data = await client.post_json(
                "/completion",
                {"prompt": list(job.tokens), "n_predict": 0, "id_slot": slot, "cache_prompt": True},
            )
            if status != 200:
                raise ProviderError(f"{self.name}: prefill answered {status}: {_message(data)}")
            timings = data.get("timings") if isinstance(data, dict) else None
            prompt_ms = timings.get("prompt_ms") if isinstance(timings, dict) else None
            status, saved = await client.post_json(f"/slots/{slot}?action=save", {"filename": job.state_file.name})
            if status != 200:
                raise ProviderError(f"{self.name}: save answered {status}: {_message(saved)}")
        except DecoderError as exc:
            raise ProviderError(f"{self.name}: {exc.message}") from exc
        n_saved = saved.get("n_saved") if isinstance(saved, dict) else None
        prompt_n = timings.get("prompt_n") if isinstance(timings, dict) else None
        return Claim(
            n_tokens=n_saved if isinstance(n_saved, int) else None,
            prefill_ms=float(prompt_ms) if isinstance(prompt_ms, int | float) else None,
            evaluated=prompt_n if isinstance(prompt_n, int) else None,
        )

    async def _share_in(self, slot: int, job: ShareJob) -> Claim:
        """Prefill and save as for a file job, then write the saved rows into the lent region."""
        path = self.state_dir / f"share-{job.id}-{secrets.token_hex(4)}.state"
        try:
            done = await self._prefill_in(slot, PrefillJob(job.id, job.model, job.n_ctx, job.tokens, path))
            try:
                written = await trio.to_thread.run_sync(
                    write_saved_state, path, list(job.tokens), job.layout, list(job.fds)
                )
            except (Refused, OSError, ValueError, KeyError) as exc:
                raise ProviderError(f"{self.name}: cannot write the shared region: {exc}") from exc
            return Claim(n_tokens=written, prefill_ms=done.prefill_ms, evaluated=done.evaluated)
        finally:
            path.unlink(missing_ok=True)

    def statistics(self) -> ProviderStatistics:
        return self.counts.statistics(self.name, self.kind, ready=self.ready, child=self.child.statistics())


def _message(data: Any) -> str:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message", data))
    return str(data)[:500]
