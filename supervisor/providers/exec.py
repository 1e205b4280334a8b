"""The ``exec`` provider: one program run per job, the contract an NPU vendor implements.

The job is one JSON object on the program's stdin; it writes the state file, logs on stderr, and its
last stdout line is its claim ``{"n_tokens": N, "prefill_ms": X}``; exit status 0 means done.
Cancelling a job kills the program's process group.  See docs/protocol.md.

onebitd cannot know what a program computes on, so its state is measured before its first job, as
another engine's is (``gate``: the daemon's fidelity check), unless its config says it runs the
decoder's own build (``fidelity_check = false``); a program the check refuses gets no job.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Awaitable
from typing import Any

import trio

from ..config import ExecProviderConfig
from ..errors import ChildError, ProviderError
from ..supervise.child import Child
from ..supervise.process import ChildProcess, describe_exit
from .base import Claim, Gate, Job, JobCounts, ProviderStatistics, ShareJob, log_refusal, parse_claim, verdict

# After the program exited, how long its last stdout bytes may take to arrive through the pipe.
_DRAIN_S = 1.0


async def pump_then_set(pump: Awaitable[None], done: trio.Event) -> None:
    await pump
    done.set()


class ExecProvider:
    kind = "exec"
    supports_share = True  # the region fds are inherited at the numbers the job lists
    engine: str | None = None  # a program of its own: onebitd does not know what it runs on
    device: str | None = None
    child: Child | None = None  # a process per job, none between them

    def __init__(self, spec: ExecProviderConfig, gate: Gate | None = None) -> None:
        self.name = spec.name
        self.spec = spec
        self.counts = JobCounts()
        self.gate = gate
        self.refused: str | None = None
        self._admitted = gate is None
        self.admitted: str | None = None  # the gate's verdict, where it admitted it (its words)
        self._settled = trio.Event()

    @property
    def ready(self) -> bool:
        # Nothing runs between jobs (a program that cannot start fails its job): ready once admitted.
        return self._admitted

    async def wait_settled(self) -> None:
        await self._settled.wait()

    @property
    def busy(self) -> int:
        return self.counts.busy

    async def run(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self)
        try:
            if self.gate is not None:
                checked = await verdict(self, self.gate, trio.lowlevel.checkpoint)
                if checked.refused is None:
                    self._admitted, self.admitted = True, checked.admitted
                else:
                    self.refused = checked.refused
                    log_refusal(self.name, checked.refused)
        finally:
            self._settled.set()
        await trio.sleep_forever()

    def cached_tokens(self, tokens: tuple[int, ...]) -> int:
        return 0  # a program's cache, if it keeps one, is its own business

    async def prefill(self, job: Job) -> Claim:
        with self.counts.track():
            return await self._run_job(job)

    async def _run_job(self, job: Job) -> Claim:
        try:
            process = await ChildProcess.spawn(
                f"provider-{self.name}[{job.id}]",
                self.spec.command,
                stdin=subprocess.PIPE,
                cpu_affinity=self.spec.cpu_affinity,
                separate_stderr=True,
                pass_fds=job.fds if isinstance(job, ShareJob) else (),
            )
        except ChildError as exc:
            raise ProviderError(str(exc)) from exc
        last = ""

        def remember(line: str) -> None:
            nonlocal last
            if line.strip():
                last = line

        output_closed = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump_then_set, process.pump_output(remember), output_closed)
                nursery.start_soon(process.pump_stderr)
                stdin = process.stdin
                assert stdin is not None
                try:
                    await stdin.send_all(json.dumps(job.wire()).encode() + b"\n")
                    await stdin.aclose()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # it exited without reading its job: its exit status says why
                # Unreaped, so stop() below can still kill what it left in its process group (a
                # helper holding stdout open must not keep the job alive: the leader's exit ends it).
                await process.wait_exited()
                with trio.move_on_after(_DRAIN_S):
                    await output_closed.wait()
                nursery.cancel_scope.cancel()
        finally:
            # Cancelled (client gone, timeout): its whole process group goes.  Always reaped.
            code = await process.stop(self.spec.kill_grace_s)
        if code != 0:
            raise ProviderError(f"{self.name}: job {job.id}: {describe_exit(code)}")
        return parse_claim(last)

    def statistics(self) -> ProviderStatistics:
        return self.counts.statistics(
            self.name, self.kind, ready=self.ready, refused=self.refused, admitted=self.admitted
        )
