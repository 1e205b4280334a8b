"""The ``llama-server`` provider: a second llama-server used only for prefill.

It runs the same model with the same ``-c``/``-np``/batch/cache parameters as the decoder (both
command lines come from the one [model] section) and saves into the decoder's ``--slot-save-path``,
so the state file it writes is one the decoder's restore accepts.  A job is
``POST /completion {"prompt": tokens, "n_predict": 0, "id_slot": k}`` then
``POST /slots/k?action=save {"filename": <name>}``; cancelling it closes that request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from ..child import Child, ChildState
from ..config import Config
from ..config import LlamaServerProvider as LlamaServerProviderConfig
from ..decoder import DecoderClient
from ..errors import DecoderError, ProviderError
from ..llama_server import LlamaServerLauncher, connection_limit
from ..slots import PromptKey, SlotPool
from .base import Claim, Job, JobCounts, PrefillJob, ProviderStatistics


class LlamaServerProvider:
    kind = "llama-server"
    supports_share = False  # it prefills into its own cache, not into someone else's region

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
        if not isinstance(job, PrefillJob):
            raise ProviderError(f"{self.name}: a llama-server provider cannot write a shared region")
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

    def statistics(self) -> ProviderStatistics:
        return self.counts.statistics(self.name, self.kind, ready=self.ready, child=self.child.statistics())


def _message(data: Any) -> str:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message", data))
    return str(data)[:500]
