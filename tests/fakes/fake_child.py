"""A stand-in for a supervised program, driven by its command line.  Standard library only.

    python tests/fakes/fake_child.py HEALTH_FILE MODE [EXIT_STATUS]

``HEALTH_FILE`` is this program's whole health API: it writes its pid there (atomically) when it is
healthy, and never touches it again, so a test makes it unhealthy by deleting the file.

    serve      healthy, then wait for a signal (SIGTERM's default action ends it)
    stubborn   ignore SIGTERM first, then as serve: only SIGKILL ends it
    family     start a stubborn grandchild in our process group (its pid in HEALTH_FILE.family), then
               serve: SIGTERM ends us, only the group's SIGKILL ends the grandchild
    exit       print a last line on stdout and one on stderr, then exit with EXIT_STATUS; never healthy
    orphan     start a stubborn grandchild as family does, then exit as exit does
    hang       never healthy; wait for a signal

Tests import :func:`running`, :func:`wait_gone` and the grandchild helpers from here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process, for tests; a zombie is not (it has exited, unreaped).

    Our own children are reaped by the code under test; an orphaned grandchild is reaped by pid 1,
    which in a container may never do it.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rpartition(")")[2].split()[0]  # the name in parentheses may hold spaces
    return state not in ("Z", "X")


async def wait_gone(pid: int) -> None:
    """Until ``pid`` has exited, for tests; any process, not only a child of ours (pidfd, no polling)."""
    import trio  # here, so that the fake child itself runs on the standard library alone

    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await trio.lowlevel.wait_readable(pidfd)
    finally:
        os.close(pidfd)


def grandchild(health: Path) -> int:
    """The pid of the grandchild a ``family`` or ``orphan`` fake child started, for tests."""
    return int(Path(f"{health}.family").read_text())


def kill_grandchild(health: Path) -> None:
    """Cleanup for tests: SIGKILL the grandchild, if one was started and still runs."""
    with contextlib.suppress(FileNotFoundError):
        pid = grandchild(health)
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def publish(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader never sees it half written."""
    scratch = path.with_name(path.name + ".tmp")
    scratch.write_text(text)
    os.replace(scratch, path)


def wait_for_signals() -> None:
    while True:
        signal.pause()


def start_grandchild(health: Path) -> None:
    # No start_new_session: the grandchild stays in our process group.
    child = subprocess.Popen([sys.executable, __file__, f"{health}.grandchild", "stubborn"], stdout=subprocess.PIPE)
    assert child.stdout is not None
    child.stdout.readline()  # its "healthy" line: it ignores SIGTERM by now
    publish(Path(f"{health}.family"), str(child.pid))


def main(argv: list[str]) -> int:
    health, mode = Path(argv[0]), argv[1]
    if mode in ("family", "orphan"):
        start_grandchild(health)
    if mode in ("exit", "orphan"):
        status = int(argv[2]) if len(argv) > 2 else 0
        print(f"fake_child: pid {os.getpid()} exiting with status {status}", flush=True)
        print(f"fake_child: last words of pid {os.getpid()}", file=sys.stderr, flush=True)
        return status
    if mode == "hang":
        wait_for_signals()
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"fake_child: pid {os.getpid()} healthy", flush=True)
    publish(health, str(os.getpid()))
    wait_for_signals()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
