"""One OS process: spawned in its own process group, tied to our life, its output logged, reaped.

This is the only module that knows subprocess details; ``OSError`` from spawning becomes
:class:`~supervisor.errors.ChildError` here.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence

import trio

from .errors import ChildError

log = logging.getLogger("onebit.child")

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _tie_to_parent(parent_pid: int, cpus: Sequence[int]) -> Callable[[], None]:
    """preexec_fn: the kernel SIGKILLs the child when we die, even when we are SIGKILLed."""

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # We may have died between fork and prctl: then nobody would ever send the signal.
        if os.getppid() != parent_pid:
            os._exit(1)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return preexec


class ChildProcess:
    """A running child.  Create with :meth:`spawn`; always finish with :meth:`stop`."""

    def __init__(self, name: str, process: trio.Process) -> None:
        self.name = name
        self._process = process
        self.returncode: int | None = None

    @classmethod
    async def spawn(
        cls,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cpu_affinity: Sequence[int] = (),
        stdin: int | None = subprocess.DEVNULL,
        pass_fds: Sequence[int] = (),
    ) -> ChildProcess:
        try:
            process = await trio.lowlevel.open_process(
                list(argv),
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                start_new_session=True,  # its own process group, so stop() reaches its children too
                preexec_fn=_tie_to_parent(os.getpid(), tuple(cpu_affinity)),
                pass_fds=tuple(pass_fds),
            )
        except OSError as exc:
            raise ChildError(f"{name}: cannot start {argv[0]}: {exc.strerror or exc}") from exc
        log.info("%s: started pid %d: %s", name, process.pid, " ".join(argv))
        return cls(name, process)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def stdin(self) -> trio.abc.SendStream | None:
        return self._process.stdin

    async def pump_output(self, on_line: Callable[[str], None] | None = None) -> None:
        """Log the child's output line by line, prefixed with its name, until it closes."""
        stream = self._process.stdout
        assert stream is not None
        buffer = b""
        async with stream:
            async for chunk in stream:
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for raw in lines:
                    self._emit(raw, on_line)
        if buffer:
            self._emit(buffer, on_line)

    def _emit(self, raw: bytes, on_line: Callable[[str], None] | None) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        if on_line is not None:
            on_line(line)
        if line:
            log.info("%s| %s", self.name, line)

    async def wait(self) -> int:
        code = await self._process.wait()
        self.returncode = code
        return code

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self._process.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            # The group leader exited and its pgid could be reused by now: signal only the pid we own.
            self._process.send_signal(sig)

    async def stop(self, grace: float) -> int:
        """Stop and reap, whatever happens around us.

        1. If it already exited, reap it and we are done.
        2. SIGTERM the process group, so llama-server can close its sockets.
        3. Wait up to ``grace`` seconds.
        4. SIGKILL the process group.
        5. Reap: no child is ever left a zombie.  The group is signalled only while the leader is
           unreaped, so its pid (and so the group id) cannot have been reused by another process.
        All under a shielded scope, so a cancelled caller still reaps.
        """
        with trio.CancelScope(shield=True):
            if self._process.poll() is None:
                self._signal_group(signal.SIGTERM)
                with trio.move_on_after(grace):
                    await self._process.wait()
                if self._process.poll() is None:
                    log.warning("%s: pid %d ignored SIGTERM for %gs; killing", self.name, self.pid, grace)
                    self._signal_group(signal.SIGKILL)
            # Reap.  No signal after this point: once reaped, its pid may belong to someone else.
            code: int = await self.wait()
        return code


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
