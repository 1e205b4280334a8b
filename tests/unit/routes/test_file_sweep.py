"""The file route removes a state file that a provider it gave up on writes late (a stopped worker
continued, a llama-server provider finishing a save after the request closed): the next handoff
removes it.  scripts/chaos's provider-worker and hang-ups scenarios found these files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from supervisor.routes.file import FileHandoff
from tests.rigs.rig import ScriptedProvider


class Decoder:
    async def post_json(self, path: str, body: Any) -> tuple[int, Any]:
        return 200, {"n_restored": 3}


async def test_a_state_file_written_after_its_job_was_abandoned_is_removed_by_the_next_handoff(
    tmp_path: Path,
) -> None:
    handoff = FileHandoff(client=Decoder(), state_dir=tmp_path, model="m", n_ctx=64)
    slow = ScriptedProvider(prefill_s=10.0, write_file=False)
    with trio.fail_after(5):
        outcome = await handoff.run(req="r1", slot=0, tokens=[1, 2, 3], provider=slow, timeout_s=0.1)
        assert outcome.reason is not None  # timed out: the request goes plain
        # The provider wakes up and writes its file after all.
        (late,) = [job.state_file for job in slow.jobs]
        late.write_text("late state")  # a small local file, as a provider would
        outcome = await handoff.run(req="r2", slot=0, tokens=[1, 2, 3], provider=ScriptedProvider(), timeout_s=5.0)
    assert outcome.ok
    assert list(tmp_path.iterdir()) == []  # noqa: ASYNC240


async def test_a_handed_over_state_file_is_not_remembered_as_abandoned(tmp_path: Path) -> None:
    handoff = FileHandoff(client=Decoder(), state_dir=tmp_path, model="m", n_ctx=64)
    with trio.fail_after(5):
        outcome = await handoff.run(req="r1", slot=0, tokens=[1, 2, 3], provider=ScriptedProvider(), timeout_s=5.0)
    assert outcome.ok
    assert list(handoff._abandoned) == []
