"""One OS process: spawned in its own process group, tied to our life, its output logged, reaped.

This is the only module that knows subprocess details; ``OSError`` (and ``SubprocessError``, when
the pre-exec step fails) from spawning becomes :class:`~supervisor.errors.ChildError` here.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence

import trio

from ..errors import ChildError
from .llama_log import relayed_level

log = logging.getLogger("onebit.child")

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Resolved here, not in the forked child: dlopen there can deadlock on a lock another thread held.
_libc = ctypes.CDLL(None, use_errno=True)


def _tie_to_parent(parent_pid: int, cpus: Sequence[int]) -> Callable[[], None]:
    """preexec_fn: the kernel SIGKILLs the child when we die, even when we are SIGKILLed.

    The signal is sent when the *thread* that forked the child exits, so the fork must happen on the
    trio thread (see :func:`_open_process`), never on a worker thread that may retire.
    """

    def preexec() -> None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # We may have died between fork and prctl: then nobody would ever send the signal.
        if os.getppid() != parent_pid:
            os._exit(1)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return preexec


class _Process:
    """The part of ``trio.Process`` we use, over a Popen forked by the trio thread itself.

    ``trio.lowlevel.open_process`` forks on a worker thread, and trio retires idle workers after
    10 s: PR_SET_PDEATHSIG then killed every child 10 s after its start.  The trio thread lives as
    long as the daemon.  Exit is seen on a pidfd, which (unlike waitpid) leaves the zombie unreaped.
    """

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        stdin: trio.lowlevel.FdStream | None,
        stdout: trio.lowlevel.FdStream,
        stderr: trio.lowlevel.FdStream | None,
    ) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self._pidfd = os.pidfd_open(popen.pid)  # Linux 5.3; readable once the process has exited
        self._wait_lock = trio.Lock()  # one task at a time may wait on an fd

    @property
    def returncode(self) -> int | None:
        """None until reaped."""
        return self._popen.returncode

    def poll(self) -> int | None:
        """Reap it if it has exited."""
        code = self._popen.poll()
        if code is not None and self._pidfd >= 0:
            trio.lowlevel.notify_closing(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
        return code

    async def wait_exited(self) -> None:
        """Until it exits, without reaping it: a zombie's pid, and so its group id, stays ours."""
        async with self._wait_lock:
            if self._pidfd >= 0:
                with contextlib.suppress(trio.ClosedResourceError):  # reaped meanwhile
                    await trio.lowlevel.wait_readable(self._pidfd)

    async def wait(self) -> int:
        """Until it exits; reap it."""
        while (code := self.poll()) is None:
            await self.wait_exited()
        return code

    def send_signal(self, sig: int) -> None:
        self._popen.send_signal(sig)


def _open_process(
    argv: Sequence[str],
    *,
    stdin: int | None,
    separate_stderr: bool,
    env: Mapping[str, str] | None,
    preexec_fn: Callable[[], None],
    pass_fds: Sequence[int],
) -> _Process:
    """Popen on the trio thread, its pipes as trio streams.

    The fork and exec block the event loop for a few milliseconds; a supervisor spawns rarely.
    """
    with contextlib.ExitStack() as child_ends, contextlib.ExitStack() as on_failure:

        def pipe(*, to_child: bool) -> tuple[trio.lowlevel.FdStream, int]:
            read, write = os.pipe()  # close-on-exec; Popen dup2s the child's end onto 0, 1 or 2
            ours, theirs = (write, read) if to_child else (read, write)
            child_ends.callback(os.close, theirs)
            stream = trio.lowlevel.FdStream(ours)
            on_failure.callback(stream.close)
            return stream, theirs

        trio_stdin = None
        if stdin == subprocess.PIPE:
            trio_stdin, stdin = pipe(to_child=True)
        trio_stdout, stdout = pipe(to_child=False)
        trio_stderr, stderr = pipe(to_child=False) if separate_stderr else (None, stdout)
        popen = subprocess.Popen(
            list(argv),
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            env=dict(env) if env is not None else None,
            start_new_session=True,  # its own process group, so stop() reaches its children too
            preexec_fn=preexec_fn,
            pass_fds=tuple(pass_fds),
        )
        try:
            process = _Process(popen, trio_stdin, trio_stdout, trio_stderr)
        except OSError:  # no pidfd: we could not wait for it
            popen.kill()
            popen.wait()
            raise
        on_failure.pop_all()
    return process


class ChildProcess:
    """A running child.  Create with :meth:`spawn`; always finish with :meth:`stop`."""

    def __init__(self, name: str, process: _Process) -> None:
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
        separate_stderr: bool = False,
    ) -> ChildProcess:
        """``separate_stderr``: stdout is the caller's to read (a provider's claim line) and stderr is
        logged by :meth:`pump_stderr`; otherwise both are one stream for :meth:`pump_output`."""
        try:
            process = _open_process(
                argv,
                stdin=stdin,
                separate_stderr=separate_stderr,
                env=env,
                preexec_fn=_tie_to_parent(os.getpid(), tuple(cpu_affinity)),
                pass_fds=pass_fds,
            )
        except OSError as exc:
            raise ChildError(f"{name}: cannot start {argv[0]}: {exc.strerror or exc}") from exc
        except subprocess.SubprocessError as exc:  # the preexec step failed (an affinity refused)
            raise ChildError(f"{name}: cannot start {argv[0]}: {exc}") from exc
        log.info("%s: started pid %d: %s", name, process.pid, " ".join(argv))
        return cls(name, process)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def stdin(self) -> trio.abc.SendStream | None:
        return self._process.stdin

    async def pump_output(self, on_line: Callable[[str], None] | None = None, *, gather_s: float = 0.0) -> None:
        """Log the child's output line by line, prefixed with its name, until it closes.

        ``gather_s``: after each read, let the next lines gather in the pipe this long before
        reading again.  llama-server writes its lines one at a time, ten or so per request: read as
        they come, they would wake this task ten times a request; the pipe (64 KiB) holds far more
        than a pause's worth.  For a long-lived child's log; not where the output is waited for (a job's
        claim line)."""
        stream = self._process.stdout
        assert stream is not None
        await self._pump(stream, on_line, gather_s)

    async def pump_stderr(self) -> None:
        """Log the child's stderr (spawned with ``separate_stderr``) line by line until it closes."""
        stream = self._process.stderr
        assert stream is not None
        await self._pump(stream, None, 0.0)

    async def _pump(
        self, stream: trio.abc.ReceiveStream, on_line: Callable[[str], None] | None, gather_s: float
    ) -> None:
        buffer = b""
        async with stream:
            async for chunk in stream:
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for raw in lines:
                    self._emit(raw, on_line)
                if gather_s:
                    await trio.sleep(gather_s)
        if buffer:
            self._emit(buffer, on_line)

    def _emit(self, raw: bytes, on_line: Callable[[str], None] | None) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        if on_line is not None:
            on_line(line)
        if line:
            level = relayed_level(line)
            if log.isEnabledFor(level):
                log.log(level, "%s| %s", self.name, line)

    async def wait(self) -> int:
        """Until it exits; reap it."""
        code = await self._process.wait()
        self.returncode = code
        return code

    async def wait_exited(self) -> None:
        """Until it exits, unreaped: :meth:`stop` can then still kill what is left of its group."""
        await self._process.wait_exited()

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

        1. If it was already reaped, we are done.
        2. SIGTERM the process group, so llama-server can close its sockets.
        3. Wait up to ``grace`` seconds for the leader to exit (not reaping it).
        4. SIGKILL the process group: the leader if it ignored SIGTERM, and whatever it left behind.
        5. Reap: no child is ever left a zombie.  The group is signalled only while the leader is
           unreaped, so its pid (and so the group id) cannot have been reused by another process.
        All under a shielded scope, so a cancelled caller still reaps.
        """
        with trio.CancelScope(shield=True):
            if self._process.returncode is None:
                self._signal_group(signal.SIGTERM)
                with trio.move_on_after(grace) as grace_scope:
                    await self._process.wait_exited()
                if grace_scope.cancelled_caught and grace > 0:  # grace 0: the caller asked for a kill
                    log.warning("%s: pid %d ignored SIGTERM for %gs; killing", self.name, self.pid, grace)
                self._signal_group(signal.SIGKILL)
            # Reap.  No signal after this point: once reaped, its pid may belong to someone else.
            code: int = await self.wait()
        return code


async def output_of(
    name: str, argv: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None
) -> tuple[list[str], int | None]:
    """Run ``argv`` once (``llama-server --version``, ``--list-devices``): its output lines and its
    exit status, or None when it was still running after ``timeout_s`` (then it is stopped)."""
    lines: list[str] = []
    process = await ChildProcess.spawn(name, argv, env=env)
    try:
        with trio.move_on_after(timeout_s):
            await process.pump_output(lines.append)
            await process.wait()
    finally:
        await process.stop(grace=0)
    return lines, process.returncode


# What a signal that ends a child by itself says about the machine, for the operator reading the log.
_MEANING = {
    # llama-server (ggml) ran an instruction the processor or its OS refuses: a build for another
    # processor, or a CPU variant whose code faults here (docs/benchmarks.md, "Which CPU variant").
    signal.SIGILL: "an instruction this processor or its OS refuses",
}


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            sig = signal.Signals(-code)
        except ValueError:
            return f"killed by signal {-code}"
        meaning = _MEANING.get(sig)
        return f"killed by {sig.name}" + (f" ({meaning})" if meaning else "")
    return f"exit status {code}"
