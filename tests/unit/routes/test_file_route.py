"""The state-file route end to end: onebitd, tests/fakes/llama/process.py restoring slot state files, and
tests/fakes/fake_provider.py writing them, as an ``exec`` and as a ``worker`` provider.

The fake decoder's slot cache behaves like llama-server's: a slot that holds the prompt evaluates one
token, an empty one evaluates the whole prompt, so ``decoder_prompt_n`` says who prefilled.  Every
fallback must still answer, correctly, and leave no state file, no process and no busy slot behind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes.llama import slots as fake_slots
from tests.rigs.helpers import client_for, gone, hang_up_when, reaped, wait_until
from tests.rigs.rig import (
    BODY,
    PROMPT,
    TAIL,
    TIMEOUT,
    DecoderModes,
    M,
    ProviderModes,
    RouteRig,
    Running,
    complete,
    plain_reply,
    ready,
    run_daemon,
)

KINDS = ["exec", "worker"]


@pytest.fixture
def rig(route_rig: RouteRig) -> RouteRig:
    return route_rig


def grandchild_gone(rig: RouteRig) -> Callable[[], bool]:
    """The hanging exec provider's own child: killed with its group (SIGKILL lands a moment after
    killpg returns, hence a condition to wait for; were the group spared, it would never hold)."""
    pid = int(rig.control.pidfile.read_text())
    return lambda: gone(pid)


def assert_nothing_left(rig: RouteRig, running: Running) -> None:
    assert rig.state_files() == []
    assert running.daemon.models.default.parts.slots.statistics().busy == 0
    assert running.daemon.models.default.parts.providers.all[0].busy == 0


# -- the route works ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_a_provider_state_file_is_restored_and_the_decoder_evaluates_one_token(rig: RouteRig, kind: str) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config(kind)) as running, client_for(running, timeout=TIMEOUT) as client:
            await ready(running, kind)
            assert await complete(client) == plain_reply()
            [line] = await rig.route_lines.until(1)
            assert_nothing_left(rig, running)
    assert (line["route"], line["fallback"], line["prefill_ms"]) == ("file", None, 7.25)
    assert line["decoder_prompt_n"] <= 2
    [restore] = rig.decoder("restore")
    [completion] = rig.decoder("completion")
    assert restore["slot"] == completion["id_slot"] == completion["slot"] == line["slot"]
    assert restore["n_restored"] == M
    assert rig.warnings() == []


@pytest.mark.parametrize("kind", KINDS)
async def test_a_last_line_that_is_not_a_claim_still_takes_the_file_route(rig: RouteRig, kind: str) -> None:
    rig.control.set(provider=ProviderModes(mode="garbage"))
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config(kind)) as running, client_for(running, timeout=TIMEOUT) as client:
            await ready(running, kind)
            assert await complete(client) == plain_reply()
            [line] = await rig.route_lines.until(1)
            assert_nothing_left(rig, running)
    assert (line["route"], line["fallback"]) == ("file", None)
    assert line["decoder_prompt_n"] <= 2
    assert rig.warnings() == []


# -- every fallback answers, correctly, and leaves nothing behind ----------------------------------

# (provider mode, decoder modes, fallback, the warning by kind; "{req}" is the request's id, and a
# warning ending in "..." is a prefix: what follows it depends on which of two events came first)
FALLBACKS: dict[str, tuple[str, DecoderModes, str, dict[str, str]]] = {
    "fail": (
        "fail",
        DecoderModes(),
        "provider-failed",
        {
            "exec": "hybrid: provider failed: npu0: job {req}: exit status 3" + TAIL,
            "worker": "hybrid: provider failed: npu0: job {req}: fake provider: told to fail" + TAIL,
        },
    ),
    "crash": (
        "crash",
        DecoderModes(),
        "provider-failed",
        {
            "exec": "hybrid: provider failed: npu0: job {req}: killed by SIGKILL" + TAIL,
            # its socket closing, or its restart: whichever onebitd sees first
            "worker": "hybrid: provider failed: npu0: job {req}: ...",
        },
    ),
    "hang": (
        "hang",
        DecoderModes(),
        "provider-failed",
        dict.fromkeys(KINDS, "hybrid: provider npu0 took over 2s" + TAIL),
    ),
    "short": (
        "short",
        DecoderModes(),
        "short-claim",
        dict.fromkeys(KINDS, f"hybrid: provider prefilled {M - 1} of {M} tokens{TAIL}"),
    ),
    "negative": (
        "negative",
        DecoderModes(),
        "short-claim",
        dict.fromkeys(KINDS, f"hybrid: provider prefilled -1 of {M} tokens{TAIL}"),
    ),
    "nofile": (
        "nofile",
        DecoderModes(),
        "provider-failed",
        dict.fromkeys(KINDS, f"hybrid: provider npu0 wrote no state file{TAIL}"),
    ),
    "restore-refused": (
        "ok",
        DecoderModes(restore_refuse=True),
        "restore-refused",
        dict.fromkeys(KINDS, f"hybrid: restore answered 400: {fake_slots.RESTORE_FAILED}{TAIL}"),
    ),
    "restore-short": (
        "ok",
        DecoderModes(restore_wrong_n=True),
        "restore-refused",
        dict.fromkeys(KINDS, f"hybrid: restored {M - 1} of {M} tokens: ..."),
    ),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(FALLBACKS))
async def test_every_fallback_answers_correctly_and_leaves_nothing_behind(rig: RouteRig, case: str, kind: str) -> None:
    mode, decoder_modes, fallback, warnings = FALLBACKS[case]
    rig.control.set(decoder=decoder_modes, provider=ProviderModes(mode=mode))
    # Hanging is the one case that waits for the timeout; every other case is over long before.
    config = rig.config(kind, prefill_timeout_s=2.0 if case == "hang" else 60.0)
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, client_for(running, timeout=TIMEOUT) as client:
            await ready(running, kind)
            assert await complete(client) == plain_reply()
            [line] = await rig.route_lines.until(1)
            assert_nothing_left(rig, running)
            if kind == "exec":
                assert all(reaped(pid) for pid in rig.provider_pids())
            if case == "hang" and kind == "worker":
                # Told to stop the job; the late answer is not waited for.
                await wait_until(lambda: rig.cancelled() == [line["req"]])
            if case == "hang" and kind == "exec":
                await wait_until(grandchild_gone(rig))
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
async def test_a_client_gone_during_the_prefill_stops_the_provider_and_leaves_nothing(rig: RouteRig, kind: str) -> None:
    rig.control.set(provider=ProviderModes(mode="hang"))
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config(kind)) as running:
            await ready(running, kind)
            if kind == "exec":
                await hang_up_when(running, BODY, rig.control.pidfile.exists)  # the provider wrote its file, and hangs
            else:
                await hang_up_when(running, BODY, lambda: bool(rig.jobs()))
            [line] = await rig.route_lines.until(1)
            assert (line["outcome"], line["status"]) == ("cancelled", 499)
            assert_nothing_left(rig, running)
            if kind == "exec":
                assert all(reaped(pid) for pid in rig.provider_pids())
                await wait_until(grandchild_gone(rig))
            else:
                await wait_until(lambda: rig.cancelled() == [line["req"]])
    assert rig.decoder("restore") == rig.decoder("completion") == []


async def test_a_client_gone_during_the_restore_leaves_nothing(rig: RouteRig) -> None:
    rig.control.set(decoder=DecoderModes(hold_restore=True))
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config("exec")) as running:
            await hang_up_when(running, BODY, lambda: bool(rig.decoder("restore-held")))
            [line] = await rig.route_lines.until(1)
            assert (line["outcome"], line["status"]) == ("cancelled", 499)
            assert_nothing_left(rig, running)
            # The decoder saw its client go and restored nothing.
            [restore] = await until_entries(rig, "restore")
            assert restore["disconnected"] is True
            rig.control.set(decoder=DecoderModes())
    assert rig.decoder("completion") == []


async def test_a_client_gone_while_the_decoder_decodes_leaves_nothing(rig: RouteRig) -> None:
    rig.control.set(decoder=DecoderModes(hold=True))
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config("exec")) as running:
            await hang_up_when(running, BODY, lambda: bool(rig.decoder("arrived")))
            [line] = await rig.route_lines.until(1)
            assert (line["route"], line["outcome"], line["status"]) == ("file", "cancelled", 499)
            assert_nothing_left(rig, running)
            [completion] = await until_entries(rig, "completion")
            assert completion["disconnected"] is True
            rig.control.set(decoder=DecoderModes())
    [restore] = rig.decoder("restore")
    assert restore["slot"] == line["slot"]


async def until_entries(rig: RouteRig, event: str) -> list[dict[str, Any]]:
    await wait_until(lambda: bool(rig.decoder(event)))
    return rig.decoder(event)


# -- concurrency ----------------------------------------------------------------------------------


async def test_concurrent_hybrid_requests_each_get_their_own_slot(rig: RouteRig) -> None:
    rig.control.set(decoder=DecoderModes(hold=True))
    prompts = [PROMPT, "a completely different prompt of seven words"]
    replies: dict[str, str] = {}
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config("exec")) as running, client_for(running, timeout=TIMEOUT) as client:

            async def ask(prompt: str) -> None:
                replies[prompt] = await complete(client, prompt)

            async with trio.open_nursery() as nursery:
                for prompt in prompts:
                    nursery.start_soon(ask, prompt)
                # Both are in the decoder at once, each pinned to a slot of its own.
                await wait_until(lambda: len(rig.decoder("arrived")) == 2)
                arrived = rig.decoder("arrived")
                assert sorted(entry["id_slot"] for entry in arrived) == [0, 1]
                assert all(entry["slot"] == entry["id_slot"] for entry in arrived)
                rig.control.set(decoder=DecoderModes())
            lines = await rig.route_lines.until(2)
            assert_nothing_left(rig, running)
    assert replies == {prompt: plain_reply(prompt) for prompt in prompts}
    assert [line["route"] for line in lines] == ["file", "file"]
    assert all(line["decoder_prompt_n"] <= 2 for line in lines)
    assert sorted(restore["slot"] for restore in rig.decoder("restore")) == [0, 1]
    assert not any(completion["slot_busy"] for completion in rig.decoder("completion"))


# -- what the route line and the metrics say about the provider --------------------------------------


def samples_of(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_the_route_line_and_the_metrics_name_the_provider_and_count_its_failure(rig: RouteRig) -> None:
    rig.control.set(provider=ProviderModes(mode=["ok", "fail"]))
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config("exec")) as running, client_for(running, timeout=TIMEOUT) as client:
            assert await complete(client) == plain_reply()
            assert await complete(client, PROMPT + " again") == plain_reply(PROMPT + " again")
            ok, failed = await rig.route_lines.until(2)
            samples = samples_of((await client.get("/metrics")).text)
    # An exec provider is a program of its own: onebitd does not know what it runs on.
    assert (ok["route"], ok["provider"], ok["engine"], ok["device"]) == ("file", "npu0", None, None)
    assert (failed["route"], failed["fallback"], failed["provider"]) == ("plain", "provider-failed", "npu0")
    where = (("device", "-"), ("engine", "-"), ("kind", "exec"), ("provider", "npu0"))
    assert samples[("onebit_provider_jobs_total", where)] == 2
    assert samples[("onebit_provider_failures_total", where)] == 1
    assert samples[("onebit_provider_ready", where)] == 1
    assert samples[("onebit_provider_refused", where)] == 0
    prefill = (("device", "-"), ("engine", "-"), ("provider", "npu0"), ("route", "file"))
    assert samples[("onebit_provider_prefill_seconds_count", prefill)] == 1


async def test_a_plain_request_names_no_provider(rig: RouteRig) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config("exec")) as running, client_for(running, timeout=TIMEOUT) as client:
            assert await complete(client, "short") == plain_reply("short")
            [line] = await rig.route_lines.until(1)
    assert (line["route"], line["fallback"]) == ("plain", "short-prompt")
    assert (line["provider"], line["engine"], line["device"]) == (None, None, None)
