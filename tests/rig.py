"""Test doubles and rig pieces shared by the route tests (in-process and subprocess alike)."""

from __future__ import annotations

import json
from typing import Any

import attrs
import trio

from supervisor.errors import ProviderError
from supervisor.providers import Claim, Job, PrefillJob, ProviderStatistics


@attrs.define
class ScriptedProvider:
    """A provider that does, in virtual time, what a test tells it to."""

    claim: Claim | None = None  # None: every token, prefill_ms 7.25
    write_file: bool = True
    error: str | None = None
    prefill_s: float = 0.0
    name: str = "scripted"
    kind: str = "scripted"
    supports_share: bool = False
    ready: bool = True
    busy: int = 0
    jobs: list[PrefillJob] = attrs.Factory(list)

    async def run(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self)

    def cached_tokens(self, tokens: tuple[int, ...]) -> int:
        return 0

    async def prefill(self, job: Job) -> Claim:
        assert isinstance(job, PrefillJob)
        self.jobs.append(job)
        if self.write_file:
            job.state_file.write_text(json.dumps({"fake_state": True, "tokens": list(job.tokens)}))
        await trio.sleep(self.prefill_s)
        if self.error is not None:
            raise ProviderError(self.error)
        return self.claim if self.claim is not None else Claim(len(job.tokens), 7.25)

    def statistics(self) -> ProviderStatistics:
        return ProviderStatistics(self.name, self.kind, True, self.busy, len(self.jobs), 0, None)
