"""The file route's effects: a provider's state file restored into the decoder slot, or a clean fallback.

The decoder is an in-test :class:`FakeSlots` (it reads the state file the way llama-server reads its
``--slot-save-path``); the provider is an in-test :class:`ScriptedProvider` where time matters (under
the autojump clock), and the real exec provider running tests/fakes/fake_provider.py everywhere else.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from supervisor.config import ExecProviderConfig
from supervisor.errors import DecoderUnavailable
from supervisor.providers import Claim, Provider
from supervisor.providers.exec import ExecProvider
from supervisor.reasons import Reason
from supervisor.routes.decision import Outcome
from supervisor.routes.file import FileHandoff
from tests.fakes.fake_provider import PATH as FAKE_PROVIDER
from tests.rigs.helpers import reaped, wait_until
from tests.rigs.rig import Control, ProviderModes, ScriptedProvider

# Starting Python a few times on two busy cores; nothing here waits for anything slower.
DEADLINE_S = 30
TOKENS = list(range(100, 130))
SLOT = 1
RESTORE = f"/slots/{SLOT}?action=restore"
ERASE = f"/slots/{SLOT}?action=erase"


@attrs.define
class FakeSlots:
    """The decoder's slot actions; records every call.  Answers in llama-server's shapes."""

    state_dir: Path
    restore_status: int = 200
    restore_short_by: int = 0
    restore_raises: bool = False
    restore_s: float = 0.0
    calls: list[tuple[str, Any]] = attrs.Factory(list)
    restored: list[list[int]] = attrs.Factory(list)

    async def post_json(self, path: str, body: Any) -> tuple[int, Any]:
        self.calls.append((path, body))
        if path == RESTORE:
            await trio.sleep(self.restore_s)
            if self.restore_raises:
                raise DecoderUnavailable("the decoder did not answer")
            state = json.loads((self.state_dir / body["filename"]).read_text())
            assert state["fake_state"] is True
            self.restored.append(state["tokens"])
            if self.restore_status != 200:
                error = {"code": self.restore_status, "message": "failed to restore slot state"}
                return self.restore_status, {"error": {**error, "type": "invalid_request_error"}}
            n_restored = len(state["tokens"]) - self.restore_short_by
            return 200, {"id_slot": SLOT, "filename": body["filename"], "n_restored": n_restored}
        if path == ERASE:
            return 200, {"id_slot": SLOT, "n_erased": 30}
        raise AssertionError(f"unexpected call {path}")

    @property
    def paths(self) -> list[str]:
        return [path for path, _ in self.calls]


@attrs.define
class Rig:
    state_dir: Path
    slots: FakeSlots
    handoff: FileHandoff
    timeout_s: float = DEADLINE_S
    outcome: Outcome | None = None

    async def run(self, provider: Provider) -> bool:
        self.outcome = await self.handoff.run(
            req="req-1", slot=SLOT, tokens=TOKENS, provider=provider, timeout_s=self.timeout_s
        )
        return self.outcome.ok

    @property
    def done(self) -> Outcome:
        assert self.outcome is not None, "the handoff returned no outcome"
        return self.outcome

    def state_files(self) -> list[Path]:
        return sorted(self.state_dir.iterdir())


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    slots = FakeSlots(state_dir)
    handoff = FileHandoff(client=slots, state_dir=state_dir, model="fake-model", n_ctx=4096)
    return Rig(state_dir, slots, handoff)


@pytest.fixture
def warnings(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    caplog.set_level(logging.INFO, logger="onebit.hybrid")

    def messages() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "onebit.hybrid" and r.levelno >= 30]

    return messages


def exec_provider() -> ExecProvider:
    return ExecProvider(ExecProviderConfig(name="npu0", command=(sys.executable, str(FAKE_PROVIDER))))


# -- success --------------------------------------------------------------------------------------


async def test_a_full_prefill_is_restored_into_the_slot_and_its_file_removed(
    rig: Rig, control: Control, warnings: Callable[[], list[str]]
) -> None:
    with trio.fail_after(DEADLINE_S):
        assert await rig.run(exec_provider())
    [(path, body)] = rig.slots.calls
    assert path == RESTORE
    [received] = control.events("provider", "job")
    assert received["job"]["state_file"] == str(rig.state_dir / body["filename"])
    assert rig.slots.restored == [TOKENS]
    assert rig.done.reason is None
    assert rig.done.prefill_ms == 7.25  # the provider's own claim
    assert rig.state_files() == []
    assert warnings() == []


async def test_the_providers_claimed_prefill_ms_wins_over_the_measured_time(
    rig: Rig, autojump_clock: trio.testing.MockClock
) -> None:
    rig.slots.restore_s = 0.25
    with trio.fail_after(DEADLINE_S):
        assert await rig.run(ScriptedProvider(prefill_s=1.0))
    assert rig.done.prefill_ms == 7.25
    assert rig.done.restore_ms == pytest.approx(250)


async def test_without_a_claimed_prefill_ms_the_measured_prefill_time_is_reported(
    rig: Rig, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(DEADLINE_S):
        assert await rig.run(ScriptedProvider(claim=Claim(n_tokens=30), prefill_s=1.5))
    assert rig.done.prefill_ms == pytest.approx(1500)


async def test_a_last_line_that_does_not_parse_still_hands_the_state_file_over(
    rig: Rig, control: Control, warnings: Callable[[], list[str]]
) -> None:
    control.set(provider=ProviderModes(mode="garbage"))
    with trio.fail_after(DEADLINE_S):
        assert await rig.run(exec_provider())
    assert rig.slots.restored == [TOKENS]
    assert (rig.done.reason, rig.state_files(), warnings()) == (None, [], [])


# -- the provider fails ---------------------------------------------------------------------------


async def test_a_provider_error_falls_back_as_provider_failed(rig: Rig, warnings: Callable[[], list[str]]) -> None:
    with trio.fail_after(DEADLINE_S):
        assert not await rig.run(ScriptedProvider(error="the NPU is on fire"))
    assert rig.done.reason is Reason.PROVIDER_FAILED
    assert (rig.done.why, warnings()) == ("provider failed: the NPU is on fire", [])
    assert (rig.slots.calls, rig.state_files()) == ([], [])


async def test_a_provider_that_crashes_after_writing_falls_back_and_its_file_is_removed(
    rig: Rig, control: Control, warnings: Callable[[], list[str]]
) -> None:
    control.set(provider=ProviderModes(mode="crash"))
    with trio.fail_after(DEADLINE_S):
        assert not await rig.run(exec_provider())
    assert rig.done.reason is Reason.PROVIDER_FAILED
    assert rig.done.why.endswith("killed by SIGKILL")
    assert warnings() == []
    assert (rig.slots.calls, rig.state_files()) == ([], [])


async def test_a_provider_that_writes_no_state_file_falls_back_as_provider_failed(
    rig: Rig, warnings: Callable[[], list[str]]
) -> None:
    with trio.fail_after(DEADLINE_S):
        assert not await rig.run(ScriptedProvider(write_file=False))
    assert rig.done.reason is Reason.PROVIDER_FAILED
    assert (rig.done.why, warnings()) == ("provider scripted wrote no state file", [])
    assert (rig.slots.calls, rig.state_files()) == ([], [])


async def test_a_provider_past_the_prefill_timeout_is_killed_and_falls_back_as_provider_failed(
    rig: Rig,
    control: Control,
    warnings: Callable[[], list[str]],
) -> None:
    control.set(provider=ProviderModes(mode="hang"))
    rig.timeout_s = 0.3
    with trio.fail_after(DEADLINE_S):
        assert not await rig.run(exec_provider())
    assert rig.done.reason is Reason.PROVIDER_FAILED
    assert (rig.done.why, warnings()) == ("provider npu0 took over 0.3s", [])
    assert (rig.slots.calls, rig.state_files()) == ([], [])
    [start] = control.events("provider", "start")
    assert reaped(start["pid"])


# -- the claim is wrong ---------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "n_tokens"), [("short", 29), ("negative", -1)])
async def test_a_wrong_count_is_named_and_the_request_goes_plain_without_a_restore(
    rig: Rig,
    control: Control,
    warnings: Callable[[], list[str]],
    mode: str,
    n_tokens: int,
) -> None:
    control.set(provider=ProviderModes(mode=mode))
    with trio.fail_after(DEADLINE_S):
        assert not await rig.run(exec_provider())
    assert rig.done.reason is Reason.SHORT_CLAIM
    assert (rig.done.why, warnings()) == (f"provider prefilled {n_tokens} of 30 tokens", [])
    assert (rig.slots.calls, rig.state_files()) == ([], [])
    assert len(control.events("provider", "job")) == 1  # and the file it wrote is gone


# -- the decoder refuses the restore --------------------------------------------------------------


async def test_a_refused_restore_erases_the_slot_and_falls_back_as_restore_refused(
    rig: Rig, warnings: Callable[[], list[str]]
) -> None:
    rig.slots.restore_status = 400
    with trio.fail_after(DEADLINE_S):
        assert not await rig.run(ScriptedProvider())
    assert rig.done.reason is Reason.RESTORE_REFUSED
    assert rig.slots.paths == [RESTORE, ERASE]
    assert (rig.done.why, warnings()) == ("restore answered 400: failed to restore slot state", [])
    assert rig.state_files() == []


async def test_a_restore_of_fewer_tokens_than_the_prompt_erases_the_slot_and_falls_back(
    rig: Rig, warnings: Callable[[], list[str]]
) -> None:
    rig.slots.restore_short_by = 1
    with trio.fail_after(DEADLINE_S):
        assert not await rig.run(ScriptedProvider())
    assert rig.done.reason is Reason.RESTORE_REFUSED
    assert rig.slots.paths == [RESTORE, ERASE]
    assert rig.done.why.startswith("restored 29 of 30 tokens: ")
    assert warnings() == []
    assert rig.state_files() == []


async def test_a_restore_the_decoder_never_answered_erases_the_slot_and_falls_back(
    rig: Rig, warnings: Callable[[], list[str]]
) -> None:
    rig.slots.restore_raises = True
    with trio.fail_after(DEADLINE_S):
        assert not await rig.run(ScriptedProvider())
    assert rig.done.reason is Reason.RESTORE_REFUSED
    assert rig.slots.paths == [RESTORE, ERASE]
    assert (rig.done.why, warnings()) == ("restore answered 0: the decoder did not answer", [])
    assert rig.state_files() == []


# -- the client leaves ----------------------------------------------------------------------------


async def test_a_client_gone_during_the_prefill_kills_the_provider_and_removes_its_file(
    rig: Rig, control: Control
) -> None:
    control.set(provider=ProviderModes(mode="hang"))
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rig.run, exec_provider())
            await wait_until(control.pidfile.exists)  # the fake writes its state file before this
            assert len(rig.state_files()) == 1
            nursery.cancel_scope.cancel()
    assert rig.state_files() == []
    assert rig.slots.calls == []
    assert rig.outcome is None  # a cancelled handoff returns nothing: no fallback to record
    [start] = control.events("provider", "start")
    assert reaped(start["pid"])
