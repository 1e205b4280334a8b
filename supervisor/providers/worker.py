"""The ``worker`` provider: a long-lived program (the model loads once) taking jobs over a socketpair.

Wire (docs/protocol.md has the full contract):
- onebitd makes a unix socketpair per life of the worker and passes one end; its fd number is in
  ``ONEBIT_PROVIDER_FD``.  Everything on it is UTF-8 JSON, one object per line.
- The worker's first line is ``{"ready": true}``: until then it is not healthy.  A worker that says
  ``{"ready": true, "ping": true}`` is pinged at each health check: ``{"ping": "<n>"}`` (n counts up
  per life), answered ``{"pong": "<n>"}`` by its reading side, even while it runs a job.  No pong within
  ``health.timeout_s`` is a failed check, so a stopped or deadlocked worker is killed and restarted; a
  pong for an earlier ping is ignored.  A worker that does not say ``"ping"`` is never pinged: its
  health is its socket, and its hang is seen only by the jobs that time out.
- onebitd sends a job line (the exec job: ``{"id", "route", "model", "n_ctx", "tokens", "state_file"}``);
  the worker answers one line per job: ``{"id", "n_tokens", "prefill_ms"}``, or ``{"id", "error"}``.
- A job onebitd no longer wants (client gone, timeout) is told with ``{"cancel": "<id>"}``; no answer
  is expected, and a late answer for it is dropped.
The worker exiting, or closing its end, fails every job in flight; it is restarted like any child.

Its state is measured before its first job, as an exec program's is (``gate``; exec.py), unless its
config says it runs the decoder's own build; a worker the check refuses is stopped.
"""

from __future__ import annotations

import array
import contextlib
import json
import logging
import os
import socket
from collections.abc import Sequence
from functools import partial
from typing import Any

import attrs
import trio

from ..config import WorkerProviderConfig
from ..errors import ProviderError
from ..supervise.child import Child, ChildState, OnTransition
from .base import Claim, Gate, Job, JobCounts, ProviderStatistics, ShareJob, log_refusal, parse_claim, verdict

log = logging.getLogger("onebit.provider")

# A claim line is small; a worker sending more than this on one line is broken.
_MAX_LINE = 1 << 20


@attrs.define
class _Pending:
    done: trio.Event = attrs.Factory(trio.Event)
    line: str = ""
    error: str | None = None


@attrs.define(eq=False)
class _Life:
    """One run of the worker program: our end of its socket, what it has said, what waits on it."""

    stream: trio.SocketStream
    ready: bool = False
    dead: bool = False
    pending: dict[str, _Pending] = attrs.Factory(dict)
    # Jobs we cancelled that may still answer without an id (see _on_line).
    cancelled_unanswered: int = 0
    send_lock: trio.Lock = attrs.Factory(trio.Lock)
    # Its ready line said "ping": true, so it answers pings and its silence is a failed check.
    pings: bool = False
    last_ping: int = 0
    # The pings (by number) whose pong is awaited: a pong for any other number is stale.
    awaiting_pong: dict[str, trio.Event] = attrs.Factory(dict)

    async def send(self, data: dict[str, Any], fds: Sequence[int] = ()) -> None:
        """One line; ``fds`` ride along with its first byte (SCM_RIGHTS), in order."""
        payload = json.dumps(data).encode() + b"\n"
        async with self.send_lock:
            if fds:
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
                sent = await self.stream.socket.sendmsg([payload], rights)
                payload = payload[sent:]
            if payload:
                await self.stream.send_all(payload)

    async def ping(self) -> bool:
        """One ping; True once its pong came.  Unbounded: the health check's timeout bounds it."""
        self.last_ping += 1
        number = str(self.last_ping)
        answered = trio.Event()
        self.awaiting_pong[number] = answered
        try:
            await self.send({"ping": number})
            await answered.wait()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        finally:
            del self.awaiting_pong[number]
        return not self.dead  # fail_all wakes it too

    def fail_all(self, why: str) -> None:
        self.dead = True
        for pending in self.pending.values():
            pending.error = why
            pending.done.set()
        for answered in self.awaiting_pong.values():
            answered.set()


class _WorkerLauncher:
    def __init__(self, provider: WorkerProvider) -> None:
        self.provider = provider
        self.name = f"provider-{provider.name}"
        self.env: dict[str, str] | None = None
        self.pass_fds: Sequence[int] = ()
        self._theirs: socket.socket | None = None

    def argv(self) -> Sequence[str]:
        return self.provider.spec.command

    def prepare(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        theirs.set_inheritable(True)
        self._theirs = theirs
        self.pass_fds = (theirs.fileno(),)
        self.env = {**os.environ, "ONEBIT_PROVIDER_FD": str(theirs.fileno())}
        self.provider._begin_life(ours)

    def fatal(self, line: str) -> str | None:
        return None  # a worker's own program: its exit says why, and a restart may help

    def spawned(self) -> None:
        # The child has its copy (or never started): ours must go, or EOF never comes when it dies.
        if self._theirs is not None:
            self._theirs.close()
            self._theirs = None

    async def healthy(self) -> bool:
        life = self.provider._life
        if life is None or not life.ready or life.dead:
            return False
        # A worker that does not answer pings is as healthy as its open socket: a stopped one too.
        return await life.ping() if life.pings else True


class WorkerProvider:
    kind = "worker"
    supports_share = True  # the region fds are sent with the job line (SCM_RIGHTS)
    engine: str | None = None  # a program of its own: onebitd does not know what it runs on
    device: str | None = None

    def __init__(
        self, spec: WorkerProviderConfig, gate: Gate | None = None, on_transition: OnTransition | None = None
    ) -> None:
        self.name = spec.name
        self.spec = spec
        self.gate = gate
        self.refused: str | None = None
        self._admitted = gate is None
        self.admitted: str | None = None  # the gate's verdict, where it admitted it (its words)
        self._checked = trio.Event()  # the gate's verdict is in (or there is no gate)
        if gate is None:
            self._checked.set()
        self.launcher = _WorkerLauncher(self)
        self.child = Child(
            self.launcher, spec.health, spec.restart, cpu_affinity=spec.cpu_affinity, on_transition=on_transition
        )
        self._capacity = trio.Semaphore(spec.concurrency)
        self._life: _Life | None = None
        self._lives_send, self._lives_receive = trio.open_memory_channel[_Life](16)
        self.counts = JobCounts()

    @property
    def ready(self) -> bool:
        return self.child.state is ChildState.READY and self._admitted

    async def wait_settled(self) -> None:
        await self.child.wait_first_start()
        if self.child.state is ChildState.READY:
            await self._checked.wait()  # healthy: settled by its check's verdict

    @property
    def busy(self) -> int:
        return self.counts.busy

    def _begin_life(self, ours: socket.socket) -> None:
        if self._life is not None:
            self._life.fail_all("the worker was restarted")
        life = _Life(trio.SocketStream(trio.socket.from_stdlib_socket(ours)))
        self._life = life
        self._lives_send.send_nowait(life)

    async def run(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read_lives, nursery)
            try:
                async with trio.open_nursery() as supervised:
                    await supervised.start(self.child.run)
                    task_status.started(self)
                    if self.gate is not None:
                        checked = await verdict(self, self.gate, partial(self.child.wait_state, ChildState.READY))
                        if checked.refused is None:
                            self._admitted, self.admitted = True, checked.admitted
                        else:
                            # Nothing will be sent to it: its program stops.
                            self.refused = checked.refused
                            log_refusal(self.name, checked.refused)
                            supervised.cancel_scope.cancel()
                    self._checked.set()
            finally:
                self._checked.set()  # stopped before its verdict: its first start is over too

    async def _read_lives(self, nursery: trio.Nursery) -> None:
        async for life in self._lives_receive:
            nursery.start_soon(self._read, life)

    async def _read(self, life: _Life) -> None:
        buffer = b""
        try:
            async with life.stream:
                while True:
                    try:
                        chunk = await life.stream.receive_some(65536)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        break
                    if not chunk:
                        break
                    buffer += chunk
                    if len(buffer) > _MAX_LINE and b"\n" not in buffer:
                        log.warning("%s: a line over %d bytes; dropping the connection", self.name, _MAX_LINE)
                        break
                    *lines, buffer = buffer.split(b"\n")
                    for raw in lines:
                        self._on_line(life, raw.decode("utf-8", "replace").strip())
        finally:
            life.fail_all(f"worker {self.name} closed its socket")

    def _on_line(self, life: _Life, line: str) -> None:
        if not line:
            return
        try:
            data = json.loads(line)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            log.warning("%s: not a JSON object: %.200s", self.name, line)
            return
        if "ready" in data:  # said once at start; a repeat is not anybody's answer
            if not life.ready and data["ready"] is True:
                life.ready = True
                life.pings = data.get("ping") is True
            return
        if "pong" in data:  # a health check's answer: never a job's, though it has no id (see below)
            answered = life.awaiting_pong.get(str(data["pong"]))
            if answered is not None:
                answered.set()
            return
        job_id = data.get("id")
        if job_id is None:
            if life.cancelled_unanswered:
                # A cancelled job's late answer, without an id: not the next job's.
                life.cancelled_unanswered -= 1
                return
            if len(life.pending) == 1:
                job_id = next(iter(life.pending))  # one job in flight: an answer without an id is its
        pending = life.pending.get(str(job_id))
        if pending is None:
            return  # a cancelled job's late answer
        error = data.get("error")
        if error is not None:
            pending.error = str(error)
        pending.line = line
        pending.done.set()

    def cached_tokens(self, tokens: tuple[int, ...]) -> int:
        return 0  # a program's cache, if it keeps one, is its own business

    async def prefill(self, job: Job) -> Claim:
        with self.counts.track():
            async with self._capacity:
                return await self._run_job(job)

    async def _run_job(self, job: Job) -> Claim:
        life = self._life
        if life is None or not life.ready or life.dead:
            raise ProviderError(f"{self.name}: no ready worker")
        pending = _Pending()
        life.pending[job.id] = pending
        try:
            try:
                if isinstance(job, ShareJob):
                    # The worker's numbers for the fds are its own: "fds" gives their order only.
                    await life.send(job.wire(list(range(len(job.fds)))), job.fds)
                else:
                    await life.send(job.wire())
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ProviderError(f"{self.name}: the worker's socket is closed") from exc
            await pending.done.wait()
        finally:
            del life.pending[job.id]
            if not pending.done.is_set() and not life.dead:
                life.cancelled_unanswered += 1
                await self._cancel(life, job.id)
        if pending.error is not None:
            raise ProviderError(f"{self.name}: job {job.id}: {pending.error}")
        return parse_claim(pending.line)

    async def _cancel(self, life: _Life, job_id: str) -> None:
        # We are being cancelled: tell the worker, briefly and shielded, then let the cancel go on.
        with (
            trio.CancelScope(shield=True),
            trio.move_on_after(1.0),
            contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
        ):
            await life.send({"cancel": job_id})

    def statistics(self) -> ProviderStatistics:
        child = self.child.statistics()
        return self.counts.statistics(
            self.name, self.kind, ready=self.ready, child=child, refused=self.refused, admitted=self.admitted
        )
