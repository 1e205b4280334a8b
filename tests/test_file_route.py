"""The state-file route end to end: onebitd, tests/fake_decoder.py restoring slot state files, and
tests/fake_provider.py writing them, as an ``exec`` and as a ``worker`` provider.

The fake decoder's slot cache behaves like llama-server's: a slot that holds the prompt evaluates one
token, an empty one evaluates the whole prompt, so ``decoder_prompt_n`` says who prefilled.  Every
fallback must still answer, correctly, and leave no state file, no process and no busy slot behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from supervisor.child import ChildState
from supervisor.config import Config

from . import fake_decoder
from .conftest import HANDOFF_ALWAYS, Control, RouteLines, Running, fake_decoder_config, run_daemon
from .fake_provider import PATH as FAKE_PROVIDER
from .fake_provider import events, gone, reaped

# Starting Python a few times on two busy cores; nothing here waits for anything slower.
TIMEOUT = 30
PROMPT = "the quick brown fox jumps over the lazy dog"
M = len(PROMPT.split())
N_PREDICT = 3
TAIL = "; the backend prefills this request itself"
KINDS = ["exec", "worker"]


def plain_reply(prompt: str = PROMPT, n: int = N_PREDICT) -> str:
    """What the fake decoder answers on /completion when it prefills the prompt itself."""
    words = prompt.split()
    return " " + " ".join(words[i % len(words)] for i in range(n))


@attrs.define
class Rig:
    runtime: Path
    control: Control
    route_lines: RouteLines
    caplog: pytest.LogCaptureFixture
    provider_log: Path
    pidfile: Path  # where a hanging exec provider writes its grandchild's pid

    def config(self, kind: str, *, prefill_timeout_s: float = 60.0) -> Config:
        command = [sys.executable, str(FAKE_PROVIDER), *(["--worker"] if kind == "worker" else [])]
        return fake_decoder_config(
            self.runtime,
            hybrid={"enabled": True, "min_prompt_tokens": 4, "prefill_timeout_s": prefill_timeout_s, **HANDOFF_ALWAYS},
            provider=[{"kind": kind, "name": "npu0", "command": command}],
        )

    def warnings(self) -> list[str]:
        return [r.getMessage() for r in self.caplog.records if r.name == "onebit.hybrid" and r.levelno >= 30]

    def state_files(self) -> list[str]:
        state = self.runtime / "state"
        return sorted(p.name for p in state.iterdir()) if state.is_dir() else []

    def decoder(self, event: str) -> list[dict[str, Any]]:
        return self.control.entries(event)

    def provider_pids(self) -> list[int]:
        return [event["pid"] for event in events(self.provider_log, "start")]


@pytest.fixture
def rig(
    short_dir: Path,
    control: Control,
    route_lines: RouteLines,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Rig]:
    for name in list(os.environ):
        if name.startswith(("FAKE_PROVIDER_", "FAKE_KVSHARE_")) or name == "ONEBIT_KV_SHARE":
            monkeypatch.delenv(name)
    made = Rig(short_dir, control, route_lines, caplog, short_dir / "provider.log", short_dir / "grandchild.pid")
    monkeypatch.setenv("FAKE_PROVIDER_LOG", str(made.provider_log))
    monkeypatch.setenv("FAKE_PROVIDER_PIDFILE", str(made.pidfile))
    caplog.set_level(logging.INFO, logger="onebit.hybrid")
    yield made
    # A grandchild that outlived a failing test is ours to end; a passing test proved it gone.
    if made.pidfile.exists() and not gone(pid := int(made.pidfile.read_text())):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def until(condition: Callable[[], bool]) -> None:
    """For another process's doing, which no trio event announces; callers run under fail_after."""
    while not condition():  # noqa: ASYNC110
        await trio.sleep(0.01)


async def ready(running: Running, kind: str) -> None:
    """A worker takes jobs once its ready line came; an exec provider needs nothing."""
    if kind == "worker":
        await running.daemon.providers.all[0].child.wait_state(ChildState.READY)  # type: ignore[attr-defined]


async def complete(client: httpx.AsyncClient, prompt: str = PROMPT) -> str:
    reply = await client.post("/completion", json={"prompt": prompt, "n_predict": N_PREDICT})
    assert reply.status_code == 200, reply.text
    content: str = reply.json()["content"]
    return content


def client_for(running: Running) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=running.url, timeout=TIMEOUT)


async def hang_up_when(running: Running, condition: Callable[[], bool]) -> None:
    """Send a request on a bare socket and close it once ``condition`` holds.

    A bare socket, because httpx leaves unclosed async generators behind when a stream is abandoned."""
    body = json.dumps({"prompt": PROMPT, "n_predict": N_PREDICT}).encode()
    host, port = running.url.removeprefix("http://").rsplit(":", 1)
    async with await trio.open_tcp_stream(host, int(port)) as raw:
        head = f"POST /completion HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(body)}\r\n\r\n"
        await raw.send_all(head.encode() + body)
        await until(condition)


def grandchild_gone(rig: Rig) -> Callable[[], bool]:
    """The hanging exec provider's own child: killed with its group (SIGKILL lands a moment after
    killpg returns, hence a condition to wait for; were the group spared, it would never hold)."""
    pid = int(rig.pidfile.read_text())
    return lambda: gone(pid)


def assert_nothing_left(rig: Rig, running: Running) -> None:
    assert rig.state_files() == []
    assert running.daemon.slots.statistics().busy == 0
    assert running.daemon.providers.all[0].busy == 0


# -- the route works ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_a_provider_state_file_is_restored_and_the_decoder_evaluates_one_token(rig: Rig, kind: str) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config(kind)) as running, client_for(running) as client:
            await ready(running, kind)
            assert await complete(client) == plain_reply()
            [line] = await rig.route_lines.wait(1)
            assert_nothing_left(rig, running)
    assert (line["route"], line["fallback"], line["prefill_ms"]) == ("file", None, 7.25)
    assert line["decoder_prompt_n"] <= 2
    [restore] = rig.decoder("restore")
    [completion] = rig.decoder("completion")
    assert restore["slot"] == completion["id_slot"] == completion["slot"] == line["slot"]
    assert restore["n_restored"] == M
    assert rig.warnings() == []


@pytest.mark.parametrize("kind", KINDS)
async def test_a_last_line_that_is_not_a_claim_still_takes_the_file_route(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.setenv("FAKE_PROVIDER_MODE", "garbage")
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config(kind)) as running, client_for(running) as client:
            await ready(running, kind)
            assert await complete(client) == plain_reply()
            [line] = await rig.route_lines.wait(1)
            assert_nothing_left(rig, running)
    assert (line["route"], line["fallback"]) == ("file", None)
    assert line["decoder_prompt_n"] <= 2
    assert rig.warnings() == []


# -- every fallback answers, correctly, and leaves nothing behind ----------------------------------

# (provider mode, decoder modes, fallback, the warning by kind; "{req}" is the request's id, and a
# warning ending in "..." is a prefix: what follows it depends on which of two events came first)
FALLBACKS: dict[str, tuple[str, dict[str, bool], str, dict[str, str]]] = {
    "fail": (
        "fail",
        {},
        "provider-failed",
        {
            "exec": "hybrid: provider failed: npu0: job {req}: exit status 3" + TAIL,
            "worker": "hybrid: provider failed: npu0: job {req}: fake provider: told to fail" + TAIL,
        },
    ),
    "crash": (
        "crash",
        {},
        "provider-failed",
        {
            "exec": "hybrid: provider failed: npu0: job {req}: killed by SIGKILL" + TAIL,
            # its socket closing, or its restart: whichever onebitd sees first
            "worker": "hybrid: provider failed: npu0: job {req}: ...",
        },
    ),
    "hang": ("hang", {}, "provider-failed", dict.fromkeys(KINDS, "hybrid: provider npu0 took over 2s" + TAIL)),
    "short": (
        "short",
        {},
        "short-claim",
        dict.fromkeys(KINDS, f"hybrid: provider prefilled {M - 1} of {M} tokens{TAIL}"),
    ),
    "negative": (
        "negative",
        {},
        "short-claim",
        dict.fromkeys(KINDS, f"hybrid: provider prefilled -1 of {M} tokens{TAIL}"),
    ),
    "nofile": (
        "nofile",
        {},
        "provider-failed",
        dict.fromkeys(KINDS, f"hybrid: provider npu0 wrote no state file{TAIL}"),
    ),
    "restore-refused": (
        "ok",
        {"restore_refuse": True},
        "restore-refused",
        dict.fromkeys(KINDS, f"hybrid: restore answered 400: {fake_decoder.RESTORE_FAILED}{TAIL}"),
    ),
    "restore-short": (
        "ok",
        {"restore_wrong_n": True},
        "restore-refused",
        dict.fromkeys(KINDS, f"hybrid: restored {M - 1} of {M} tokens: ..."),
    ),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(FALLBACKS))
async def test_every_fallback_answers_correctly_and_leaves_nothing_behind(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, case: str, kind: str
) -> None:
    mode, decoder_modes, fallback, warnings = FALLBACKS[case]
    monkeypatch.setenv("FAKE_PROVIDER_MODE", mode)
    rig.control.set(**decoder_modes)
    # Hanging is the one case that waits for the timeout; every other case is over long before.
    config = rig.config(kind, prefill_timeout_s=2.0 if case == "hang" else 60.0)
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, client_for(running) as client:
            await ready(running, kind)
            assert await complete(client) == plain_reply()
            [line] = await rig.route_lines.wait(1)
            assert_nothing_left(rig, running)
            if kind == "exec":
                assert all(reaped(pid) for pid in rig.provider_pids())
            if case == "hang" and kind == "worker":
                # Told to stop the job; the late answer is not waited for.
                await until(lambda: [e["id"] for e in events(rig.provider_log, "cancel")] == [line["req"]])
            if case == "hang" and kind == "exec":
                await until(grandchild_gone(rig))
    assert (line["route"], line["fallback"], line["outcome"]) == ("plain", fallback, "ok")
    [warning] = rig.warnings()
    expected = warnings[kind].format(req=line["req"])
    if expected.endswith("..."):
        assert warning.startswith(expected.removesuffix("..."))
        assert warning.endswith(TAIL)
    else:
        assert warning == expected
    # The decoder prefilled the prompt itself, in the slot the request was pinned to: nothing a
    # failed restore left in it was used.
    assert line["decoder_prompt_n"] == M
    [completion] = rig.decoder("completion")
    assert (completion["id_slot"], completion["prompt_n"]) == (line["slot"], M)
    restores = rig.decoder("restore")
    if case.startswith("restore"):
        [erase] = rig.decoder("erase")
        assert erase["slot"] == line["slot"]
    else:
        assert restores == []


# -- cancellation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_a_client_gone_during_the_prefill_stops_the_provider_and_leaves_nothing(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.setenv("FAKE_PROVIDER_MODE", "hang")
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config(kind)) as running:
            await ready(running, kind)
            if kind == "exec":
                await hang_up_when(running, rig.pidfile.exists)  # the provider wrote its file, and hangs
            else:
                await hang_up_when(running, lambda: bool(events(rig.provider_log, "job")))
            [line] = await rig.route_lines.wait(1)
            assert (line["outcome"], line["status"]) == ("cancelled", 499)
            assert_nothing_left(rig, running)
            if kind == "exec":
                assert all(reaped(pid) for pid in rig.provider_pids())
                await until(grandchild_gone(rig))
            else:
                await until(lambda: [e["id"] for e in events(rig.provider_log, "cancel")] == [line["req"]])
    assert rig.decoder("restore") == rig.decoder("completion") == []


async def test_a_client_gone_during_the_restore_leaves_nothing(rig: Rig) -> None:
    rig.control.set(hold_restore=True)
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config("exec")) as running:
            await hang_up_when(running, lambda: bool(rig.decoder("restore-held")))
            [line] = await rig.route_lines.wait(1)
            assert (line["outcome"], line["status"]) == ("cancelled", 499)
            assert_nothing_left(rig, running)
            # The decoder saw its client go and restored nothing.
            [restore] = await until_entries(rig, "restore")
            assert restore["disconnected"] is True
            rig.control.set()
    assert rig.decoder("completion") == []


async def test_a_client_gone_while_the_decoder_decodes_leaves_nothing(rig: Rig) -> None:
    rig.control.set(hold=True)
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config("exec")) as running:
            await hang_up_when(running, lambda: bool(rig.decoder("arrived")))
            [line] = await rig.route_lines.wait(1)
            assert (line["route"], line["outcome"], line["status"]) == ("file", "cancelled", 499)
            assert_nothing_left(rig, running)
            [completion] = await until_entries(rig, "completion")
            assert completion["disconnected"] is True
            rig.control.set()
    [restore] = rig.decoder("restore")
    assert restore["slot"] == line["slot"]


async def until_entries(rig: Rig, event: str) -> list[dict[str, Any]]:
    await until(lambda: bool(rig.decoder(event)))
    return rig.decoder(event)


# -- concurrency ----------------------------------------------------------------------------------


async def test_concurrent_hybrid_requests_each_get_their_own_slot(rig: Rig) -> None:
    rig.control.set(hold=True)
    prompts = [PROMPT, "a completely different prompt of seven words"]
    replies: dict[str, str] = {}
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config("exec")) as running, client_for(running) as client:

            async def ask(prompt: str) -> None:
                replies[prompt] = await complete(client, prompt)

            async with trio.open_nursery() as nursery:
                for prompt in prompts:
                    nursery.start_soon(ask, prompt)
                # Both are in the decoder at once, each pinned to a slot of its own.
                await until(lambda: len(rig.decoder("arrived")) == 2)
                arrived = rig.decoder("arrived")
                assert sorted(entry["id_slot"] for entry in arrived) == [0, 1]
                assert all(entry["slot"] == entry["id_slot"] for entry in arrived)
                rig.control.set()
            lines = await rig.route_lines.wait(2)
            assert_nothing_left(rig, running)
    assert replies == {prompt: plain_reply(prompt) for prompt in prompts}
    assert [line["route"] for line in lines] == ["file", "file"]
    assert all(line["decoder_prompt_n"] <= 2 for line in lines)
    assert sorted(restore["slot"] for restore in rig.decoder("restore")) == [0, 1]
    assert not any(completion["slot_busy"] for completion in rig.decoder("completion"))
