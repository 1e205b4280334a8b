"""ChildProcess (output, stop, process group) and onebitd's promise that no child outlives it."""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomli_w
import trio

from supervisor import config as configuration
from supervisor.config import Config
from supervisor.errors import ChildError
from supervisor.supervise import llama_log
from supervisor.supervise.process import ChildProcess, describe_exit
from tests.fakes.fake_child import grandchild, kill_grandchild, running, wait_gone
from tests.rigs.helpers import chat
from tests.rigs.rig import env_without, fake_decoder_config, make_config, real_llama_server

FAKE_CHILD = Path(__file__).parents[2] / "fakes" / "fake_child.py"
REPO = Path(__file__).parents[3]


def fake_child(health: Path, *mode: str) -> list[str]:
    return [sys.executable, str(FAKE_CHILD), str(health), *mode]


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (0, "exit status 0"),
        (3, "exit status 3"),
        (-signal.SIGTERM, "killed by SIGTERM"),
        # A ggml CPU variant whose code faults here (the AMX tile config once did): the operator is
        # told what the signal means, not only its name.
        (-signal.SIGILL, "killed by SIGILL (an instruction this processor or its OS refuses)"),
        (-200, "killed by signal 200"),
    ],
)
def test_an_exit_is_told_in_words_and_sigill_says_what_it_means(code: int, words: str) -> None:
    assert describe_exit(code) == words


@pytest.mark.parametrize("gather_s", [0.0, 0.02])
async def test_output_is_logged_line_by_line_prefixed_with_the_name(
    caplog: pytest.LogCaptureFixture, gather_s: float
) -> None:
    caplog.set_level(logging.DEBUG, logger="onebit.child")
    script = "import sys; sys.stdout.write('one\\ntwo\\r\\n'); sys.stdout.flush(); sys.stderr.write('three')"
    seen: list[str] = []
    with trio.fail_after(10):
        process = await ChildProcess.spawn("talker", [sys.executable, "-c", script])
        try:
            await process.pump_output(seen.append, gather_s=gather_s)
        finally:
            code = await process.stop(5)
    assert code == 0
    assert seen == ["one", "two", "three"]  # stderr joins stdout; the unterminated last line too
    logged = [r.getMessage() for r in caplog.records if "| " in r.getMessage()]
    assert logged == ["talker| one", "talker| two", "talker| three"]


@pytest.mark.parametrize(
    ("children", "info"),
    [
        # log.children's default: a child's info lines (and lines with no mark) are debug.
        ("warning", "DEBUG"),
        ("info", "INFO"),
    ],
)
async def test_llama_servers_lines_are_logged_from_log_children_up_and_the_per_request_ones_at_debug(
    caplog: pytest.LogCaptureFixture, children: str, info: str
) -> None:
    caplog.set_level(logging.DEBUG, logger="onebit.child")
    lines = [
        "0.00.004.663 I srv    load_model: loading model 'm.gguf'",
        "1.14.070.548 I slot print_timing: id  0 | task 4497 | prompt eval time =      17.10 ms /     1 tokens",
        "1.13.951.584 W slot   operator(): id  0 | task 4491 | need to evaluate at least 1 token",
        "0.00.002.784 W srv  llama_server: security: no API key is set and CORS allows all origins",
        "0.00.002.785 W srv  init: the slot context (8192) exceeds the training context of the model (4096)",
        "1.20.000.000 E slot launch_slot_: id  0 | task 12 | failed",
        "not llama.cpp's format",
    ]
    script = f"import sys; sys.stdout.write({chr(10).join(lines)!r} + '\\n')"
    llama_log.set_children_level(children)
    try:
        with trio.fail_after(10):
            process = await ChildProcess.spawn("decoder", [sys.executable, "-c", script])
            try:
                await process.pump_output()
            finally:
                await process.stop(5)
    finally:
        llama_log.set_children_level("warning")
    levels = {r.getMessage().split("| ", 1)[1]: r.levelname for r in caplog.records if "| " in r.getMessage()}
    assert [levels[line] for line in lines] == [info, "DEBUG", "DEBUG", "DEBUG", "WARNING", "ERROR", info]


async def test_stop_reaps_even_when_the_caller_is_cancelled(short_dir: Path) -> None:
    health = short_dir / "healthy"
    healthy = trio.Event()
    with trio.fail_after(20):
        process = await ChildProcess.spawn("fake", fake_child(health, "serve"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(process.pump_output, lambda line: healthy.set() if "healthy" in line else None)
            await healthy.wait()
            reached_after_stop = False
            with trio.CancelScope() as scope:
                scope.cancel()
                code = await process.stop(5)  # shielded inside: it finishes under a cancelled caller
                reached_after_stop = True
                await trio.lowlevel.checkpoint()  # where the cancellation lands
                pytest.fail("the caller's cancellation was lost")
    assert scope.cancelled_caught
    assert reached_after_stop
    assert code == -signal.SIGTERM
    assert process.returncode == code
    assert not running(process.pid)


async def test_stop_sigkills_the_whole_process_group_so_no_grandchild_survives(short_dir: Path) -> None:
    health = short_dir / "healthy"
    with trio.fail_after(20):
        process = await ChildProcess.spawn("fake", fake_child(health, "family"))
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(process.pump_output, lambda line: nursery.cancel_scope.cancel())
            left = grandchild(health)  # published before the child's first line
            assert running(left)
            code = await process.stop(5)  # the leader obeys at once: no wait for the grace
            # The leader obeyed SIGTERM; the grandchild ignores it and only the group SIGKILL ends it.
            assert code == -signal.SIGTERM
            await wait_gone(left)
        finally:
            await process.stop(0)
            kill_grandchild(health)


async def test_stop_kills_what_an_exited_leader_left_in_its_group(short_dir: Path) -> None:
    health = short_dir / "healthy"
    with trio.fail_after(20):
        process = await ChildProcess.spawn("fake", fake_child(health, "orphan", "4"))
        try:
            await process.wait_exited()
            assert process.returncode is None  # exited, not reaped: its group id is still ours
            left = grandchild(health)
            assert running(left)
            assert await process.stop(5) == 4
            await wait_gone(left)
        finally:
            await process.stop(0)
            kill_grandchild(health)


async def test_a_program_that_cannot_be_started_is_a_child_error(short_dir: Path) -> None:
    missing = short_dir / "no-such-program"
    with trio.fail_after(10), pytest.raises(ChildError, match=r"^fake: cannot start .*: No such file or directory$"):
        await ChildProcess.spawn("fake", [str(missing)])


async def test_a_cpu_affinity_the_kernel_refuses_is_a_child_error(short_dir: Path) -> None:
    # The pre-exec step fails in the forked child; Popen reports that as SubprocessError, not OSError.
    impossible_cpu = 1 << 20
    with trio.fail_after(10), pytest.raises(ChildError, match=r"^fake: cannot start"):
        await ChildProcess.spawn("fake", fake_child(short_dir / "healthy", "serve"), cpu_affinity=[impossible_cpu])


# -- onebitd as a real process -------------------------------------------------------------------


class Onebitd:
    """onebitd run as ``python -m supervisor.daemon``; its log read from stderr, line by line."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.lines: list[str] = []
        self.eof = False
        self._changed = trio.Event()

    async def read_log(self) -> None:
        assert self.process.stderr is not None
        buffer = b""
        async for chunk in self.process.stderr:
            buffer += chunk
            *done, buffer = buffer.split(b"\n")
            self.lines += [line.decode("utf-8", "replace") for line in done]
            self._poke()
        self.eof = True
        self._poke()

    def _poke(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, pattern: str) -> re.Match[str]:
        """The first log line matching ``pattern``, once it is written."""
        seen = 0
        while True:
            for line in self.lines[seen:]:
                if match := re.search(pattern, line):
                    return match
            seen = len(self.lines)
            if self.eof:
                raise AssertionError(f"no line matches {pattern!r} in onebitd's log:\n" + "\n".join(self.lines))
            await self._changed.wait()

    async def decoder_ready(self) -> int:
        """The pid of the decoder, once it is ready."""
        pid = int((await self.wait_for(r"decoder: started pid (\d+)"))[1])
        await self.wait_for(r"decoder: starting -> ready")
        return pid


@asynccontextmanager
async def onebitd(runtime_dir: Path, config: Config | None = None) -> AsyncIterator[Onebitd]:
    """Start onebitd on ``config`` (a fake-decoder one by default); SIGKILL and reap it on the way
    out, whatever happened."""
    config_file = runtime_dir / "onebit.toml"
    config = config or fake_decoder_config(runtime_dir)
    config_file.write_text(tomli_w.dumps(configuration.unstructure(config)))
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "supervisor.daemon", "--config", str(config_file)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env=env_without("JOURNAL_STREAM", "ONEBIT_CONFIG"),
    )
    daemon = Onebitd(process)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(daemon.read_log)
            yield daemon
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
            await process.wait()


async def test_no_decoder_outlives_onebitd_killed_with_sigkill(short_dir: Path) -> None:
    with trio.fail_after(30):
        async with onebitd(short_dir) as daemon:
            decoder = await daemon.decoder_ready()
            assert running(decoder)
            daemon.process.kill()  # no chance to clean up: only PR_SET_PDEATHSIG can end the decoder
            assert await daemon.process.wait() == -signal.SIGKILL
            await wait_gone(decoder)


async def test_sigterm_makes_onebitd_exit_0_after_stopping_its_decoder(short_dir: Path) -> None:
    with trio.fail_after(30):
        async with onebitd(short_dir) as daemon:
            decoder = await daemon.decoder_ready()
            daemon.process.send_signal(signal.SIGTERM)
            assert await daemon.process.wait() == 0
            await daemon.wait_for(r"decoder: stopping -> stopped")
            # onebitd reaped it before exiting: nothing is left to reap, or to be killed by the kernel.
            assert not running(decoder)


# A line a child wrote, as onebitd logs it: ``<time> <level> onebit.child: decoder| <line>``.
CHILD_LINE = re.compile(r"^\S+ \w+ onebit\.child: \S+\| ")


@pytest.mark.parametrize("decoder", ["fake", pytest.param("real", marks=pytest.mark.real)])
async def test_the_first_30_lines_of_onebitds_log_are_its_own_not_its_childrens(short_dir: Path, decoder: str) -> None:
    if decoder == "real":
        real_llama_server()
        config = make_config(short_dir, model={"parallel": 2, "ctx_size": 1024})
    else:
        config = fake_decoder_config(short_dir)
    with trio.fail_after(180):
        async with onebitd(short_dir, config) as daemon:
            url = (await daemon.wait_for(r"ready: serving on (\S+?)[;,]?$"))[1]
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                reply = await client.post("/v1/chat/completions", json=chat("Say hi"))
            assert reply.status_code == 200
            await daemon.wait_for(r"onebit\.route: ")  # the request's route line, after its slot lines
            # The restore probe's verdict: logged when the probe ends, which may be after "ready" and
            # the first request (it is asked of the decoder beside them).
            await daemon.wait_for(r" model \S+: (restores|no restore probe)")
            first = daemon.lines[:30]
            said = "\n".join(daemon.lines)
    assert [line for line in first if CHILD_LINE.match(line)] == [], "\n".join(first)
    said_of_itself = (
        r" llama-server \S+: version: ",
        r" onebitd \S+ listening on ",
        r" decoder: starting -> ready ",
        r" model \S+: restores ",
        r" ready: serving on ",
    )
    for own in said_of_itself:
        assert re.search(own, said), (own, said)


async def test_children_are_forked_by_the_trio_thread_which_lives_as_long_as_the_daemon(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # PR_SET_PDEATHSIG fires when the *thread* that forked the child exits.  trio's open_process
    # forks on a worker thread, which trio retires after 10 idle seconds: the decoder died with it.
    forked_on: list[int] = []
    real_popen = subprocess.Popen

    def recording_popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        forked_on.append(threading.get_ident())
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    with trio.fail_after(10):
        process = await ChildProcess.spawn("fake", fake_child(short_dir / "healthy", "exit"))
        try:
            assert await process.wait() == 0
        finally:
            await process.stop(0)
    assert forked_on == [threading.get_ident()]
