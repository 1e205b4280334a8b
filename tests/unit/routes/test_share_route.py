"""The share route end to end: onebitd, tests/fakes/llama/process.py lending its KV as memfds, and
tests/fakes/fake_share_provider.py writing the rows into them.

Every test runs onebitd in-process with the share route on, and checks what the decoder and the
provider saw (their logs), what onebitd said (its hybrid log and the route line), and what the client
got.  The fake decoder's slot cache behaves like llama-server's: a slot that holds the prompt evaluates
one token, a slot that does not evaluates the whole prompt, so ``decoder_prompt_n`` says who prefilled.
The fallback boundary under test is docs/protocol.md's: a handshake failure takes the state-file route,
anything after the provider ran goes plain.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from supervisor.admin import render
from supervisor.errors import ShareRefused
from supervisor.routes.share import parse_header
from supervisor.supervise.child import ChildState
from tests.fakes import fake_share_provider
from tests.fakes.llama import share as fake_share
from tests.fakes.llama import slots as fake_slots
from tests.rigs.helpers import client_for, hang_up_when, reaped, with_model
from tests.rigs.rig import (
    BODY,
    HYBRID_GGUF,
    PROMPT,
    TAIL,
    TIMEOUT,
    DecoderModes,
    M,
    RouteRig,
    ShareModes,
    complete,
    plain_reply,
    ready,
    run_daemon,
)

CANNOT_SHARE = "this decoder cannot share its KV; the state-file route is used"


@pytest.fixture
def rig(route_rig: RouteRig) -> RouteRig:
    route_rig.provider, route_rig.mode = "share", "share"
    return route_rig


@pytest.fixture
def fast_connect_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    # A decoder that never connects is waited for this long; the daemon reads it when it starts.
    monkeypatch.setattr("supervisor.models.parts.SHARE_CONNECT_TIMEOUT_S", 0.5)


def open_fds() -> list[str]:
    """What this process's (onebitd's) fds are open on, without inode numbers: a socket by its
    family and addresses, a pipe as ``pipe``.  Equal lists mean nothing was left open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:
            continue  # the directory's own fd, gone by now
        if target.startswith("socket:"):
            with socket.socket(fileno=os.dup(int(fd))) as sock:
                try:
                    peer = sock.getpeername()
                except OSError:
                    peer = None
                target = f"socket {sock.family.name} {sock.getsockname()!r} -> {peer!r}"
        elif target.startswith("pipe:"):
            target = "pipe"
        found.append(target)
    return sorted(found)


def assert_pinned(rig: RouteRig, line: dict[str, Any]) -> dict[str, Any]:
    """The decoder's record of the request: pinned to the slot onebitd held."""
    [completion] = rig.decoder("completion")[-1:]
    assert completion["id_slot"] == line["slot"] == completion["slot"]
    return completion


# -- the share route ------------------------------------------------------------------------------


def test_the_fake_decoder_and_the_fake_provider_agree_on_every_row() -> None:
    for token, pos, tensor, row_bytes in [(0, 0, "cache_k_l0", 16), (49151, 4095, "cache_v_l1", 16), (7, 3, "x", 80)]:
        row = fake_share.expected_row(token, pos, tensor, row_bytes)
        assert row == fake_share_provider.expected_row(token, pos, tensor, row_bytes)
        assert len(row) == row_bytes
        assert row[:4] == token.to_bytes(4, "big")
    # A row for another position or tensor differs: a row written in the wrong place is caught.
    assert fake_share.expected_row(5, 1, "cache_k_l0", 16) != fake_share.expected_row(5, 2, "cache_k_l0", 16)
    assert fake_share.expected_row(5, 1, "cache_k_l0", 16) != fake_share.expected_row(5, 1, "cache_v_l0", 16)


@pytest.mark.parametrize(
    ("kind", "enable", "regions"),
    [("exec", "config", 2), ("exec", "env", 2), ("worker", "config", 2), ("exec", "config", 1)],
    ids=["exec-hybrid.mode", "exec-ONEBIT_KV_SHARE", "worker-hybrid.mode", "exec-one-region"],
)
async def test_a_shared_prompt_is_adopted_into_the_pinned_slot_and_the_decoder_evaluates_one_token(
    rig: RouteRig, monkeypatch: pytest.MonkeyPatch, kind: str, enable: str, regions: int
) -> None:
    if enable == "env":
        monkeypatch.setenv("ONEBIT_KV_SHARE", "1")
    rig.control.set(decoder=DecoderModes(kvshare_regions=regions))
    config = rig.config(kind=kind, mode="share" if enable == "config" else "file")
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, client_for(running, timeout=TIMEOUT) as client:
            await ready(running, kind)
            assert await complete(client) == plain_reply()
            [line] = await rig.route_lines.until(1)
    assert (line["route"], line["fallback"], line["outcome"]) == ("share", None, "ok")
    assert line["share_ms"] > 0
    assert line["prefill_ms"] == 3.5  # the provider's own number
    assert line["decoder_prompt_n"] <= 2
    completion = assert_pinned(rig, line)
    assert completion["prompt_n"] == 1
    [share] = rig.decoder("share")
    [adopt] = rig.decoder("adopt")
    assert share["slot"] == adopt["slot"] == line["slot"]
    assert (share["n_tokens"], adopt["n_tokens"], adopt["n_adopted"]) == (M, M, M)
    [job] = rig.jobs()
    assert (job["route"], job["n_tokens"]) == ("share", M)
    assert len(job["fds"]) == regions  # every region the decoder lent reached the provider
    assert len(rig.control.written()) == 1
    assert rig.decoder("restore") == []
    assert rig.warnings() == []
    assert rig.leftovers() == []


async def test_a_refused_share_takes_the_state_file_route_and_says_so(
    rig: RouteRig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.control.set(decoder=DecoderModes(kvshare_refuse=True))
    caplog.set_level(logging.INFO, logger="onebit.route")
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config()) as running, client_for(running, timeout=TIMEOUT) as client:
            assert await complete(client) == plain_reply()
            [line] = await rig.route_lines.until(1)
    refusal = json.dumps({"error": {"message": fake_slots.SHARE_REFUSED}})
    assert rig.warnings() == [f"hybrid: share answered 400: {refusal}; {CANNOT_SHARE}"]
    assert (line["route"], line["fallback"], line["share_ms"]) == ("file", "share-refused", 0.0)
    [logfmt] = [r.getMessage() for r in caplog.records if r.name == "onebit.route"]
    assert " share_ms=0.000 " in logfmt
    # The provider ran once, on the file route, and its state file is what the decoder restored.
    [job] = rig.jobs()
    assert job["route"] == "file"
    [restore] = rig.decoder("restore")
    assert restore["filename"] == Path(job["state_file"]).name
    assert (restore["slot"], restore["n_restored"]) == (line["slot"], M)
    # The decoder did not prefill the prompt itself.
    assert line["decoder_prompt_n"] <= 2
    assert assert_pinned(rig, line)["prompt_n"] == 1
    assert rig.decoder("adopt") == []
    assert rig.leftovers() == []


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("kvshare_no_id", "share answered 200 without a share_id: "),
        ("kvshare_no_connect", "the decoder did not connect within 0.5s"),
        ("kvshare_bad_header", "the share header lists 2 regions but 1 fds came with it"),
    ],
    ids=["no-share-id", "never-connects", "bad-header"],
)
async def test_every_handshake_failure_takes_the_state_file_route(
    rig: RouteRig, fast_connect_timeout: None, mode: str, why: str
) -> None:
    rig.control.set(decoder=DecoderModes(**{mode: True}))
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config()) as running, client_for(running, timeout=TIMEOUT) as client:
            assert await complete(client) == plain_reply()
            [line] = await rig.route_lines.until(1)
            fds = open_fds()
    [warning] = rig.warnings()
    assert warning.startswith(f"hybrid: {why}")
    assert warning.endswith(f"; {CANNOT_SHARE}")
    assert (line["route"], line["fallback"], line["share_ms"]) == ("file", "share-refused", 0.0)
    assert [job["route"] for job in rig.jobs()] == ["file"]
    [restore] = rig.decoder("restore")
    assert restore["n_restored"] == M
    assert line["decoder_prompt_n"] <= 2
    assert not any("memfd:" in target for target in fds)  # a region that came with a bad header was closed
    assert rig.leftovers() == []


async def test_an_adopt_refusal_goes_plain_and_never_takes_the_state_file_route(rig: RouteRig) -> None:
    rig.control.set(decoder=DecoderModes(kvshare_adopt_refuse=True))
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config()) as running, client_for(running, timeout=TIMEOUT) as client:
            assert await complete(client) == plain_reply()
            [line] = await rig.route_lines.until(1)
    # The provider did run and write: a file-route retry would pay for the prefill twice.
    [job] = rig.jobs()
    assert job["route"] == "share"
    assert len(rig.control.written()) == 1
    [warning] = rig.warnings()
    assert warning.startswith("hybrid: adopt answered 400: ")
    assert "Cannot adopt the shared cells" in warning
    assert warning.endswith(TAIL)
    assert not any(CANNOT_SHARE in message for message in rig.hybrid())
    assert (line["route"], line["fallback"]) == ("plain", "adopt-refused")
    assert rig.decoder("restore") == []
    [erase] = rig.decoder("erase")
    assert erase["slot"] == line["slot"]
    assert line["decoder_prompt_n"] == M
    assert rig.leftovers() == []


async def test_a_short_claim_is_named_and_no_cells_are_adopted(rig: RouteRig) -> None:
    rig.control.set(share=ShareModes(short=True))
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config()) as running, client_for(running, timeout=TIMEOUT) as client:
            assert await complete(client) == plain_reply()
            [line] = await rig.route_lines.until(1)
    assert rig.warnings() == [f"hybrid: provider prefilled {M - 1} of {M} tokens into the shared region{TAIL}"]
    assert rig.decoder("adopt") == []
    assert (line["route"], line["fallback"]) == ("plain", "short-claim")
    # The decoder prefills the whole prompt itself.
    assert line["decoder_prompt_n"] == M
    assert assert_pinned(rig, line)["prompt_n"] == M
    assert [job["route"] for job in rig.jobs()] == ["share"]
    assert rig.decoder("restore") == []


@pytest.mark.parametrize("kind", ["exec", "worker"])
async def test_a_hybrids_share_is_adopted_when_the_claim_names_every_state_row_written(
    rig: RouteRig, kind: str
) -> None:
    rig.control.set(decoder=DecoderModes(kvshare_state=True), share=ShareModes(state_rows=True))
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config(kind=kind)) as running, client_for(running, timeout=TIMEOUT) as client:
            await ready(running, kind)
            assert await complete(client) == plain_reply()
            [line] = await rig.route_lines.until(1)
    assert (line["route"], line["fallback"], line["outcome"]) == ("share", None, "ok")
    [job] = rig.jobs()
    assert len(job["fds"]) == 3  # K, V, and the staging region of the recurrent state
    [adopt] = rig.decoder("adopt")
    assert (adopt["n_adopted"], adopt["state_ok"]) == (M, True)
    assert rig.warnings() == []


@pytest.mark.parametrize("kind", ["exec", "worker"])
async def test_a_hybrids_share_whose_claim_does_not_name_its_state_rows_is_not_adopted(
    rig: RouteRig, kind: str
) -> None:
    # A provider that writes only K/V (the protocol before state rows) and claims every token: the
    # staging region holds whatever the slot's previous share left, another conversation's state.
    rig.control.set(decoder=DecoderModes(kvshare_state=True))
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config(kind=kind)) as running, client_for(running, timeout=TIMEOUT) as client:
            await ready(running, kind)
            assert await complete(client) == plain_reply()
            [line] = await rig.route_lines.until(1)
    why = "hybrid: provider claimed none of the 2 recurrent state rows it had to write into the shared region"
    assert rig.warnings() == [why + TAIL]
    assert (line["route"], line["fallback"]) == ("plain", "share-state-unclaimed")
    assert rig.decoder("adopt") == []
    [erase] = rig.decoder("erase")
    assert erase["slot"] == line["slot"]
    assert line["decoder_prompt_n"] == M
    assert [job["route"] for job in rig.jobs()] == ["share"]
    assert rig.decoder("restore") == []


@pytest.mark.parametrize(
    ("mode", "fallback", "warning"),
    [
        ("crash", "provider-failed", "hybrid: provider failed: npu0: job {req}: killed by SIGKILL" + TAIL),
        ("negative", "short-claim", f"hybrid: provider prefilled -1 of {M} tokens into the shared region{TAIL}"),
    ],
    ids=["crash-after-writing", "negative-claim"],
)
async def test_a_provider_that_wrote_the_region_and_then_failed_goes_plain(
    rig: RouteRig, mode: str, fallback: str, warning: str
) -> None:
    rig.control.set(share=ShareModes(**{mode: True}))
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config()) as running, client_for(running, timeout=TIMEOUT) as client:
            assert await complete(client) == plain_reply()
            [line] = await rig.route_lines.until(1)
    assert len(rig.control.written()) == 1
    assert rig.warnings() == [warning.format(req=line["req"])]
    assert (line["route"], line["fallback"]) == ("plain", fallback)
    assert [job["route"] for job in rig.jobs()] == ["share"]
    assert (rig.decoder("adopt"), rig.decoder("restore")) == ([], [])
    assert line["decoder_prompt_n"] == M
    assert rig.leftovers() == []


async def test_a_last_line_that_is_not_a_claim_still_adopts_the_region(rig: RouteRig) -> None:
    rig.control.set(share=ShareModes(garbage=True))
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config()) as running, client_for(running, timeout=TIMEOUT) as client:
            assert await complete(client) == plain_reply()
            [line] = await rig.route_lines.until(1)
    assert (line["route"], line["fallback"]) == ("share", None)
    [adopt] = rig.decoder("adopt")
    assert adopt["n_adopted"] == M
    assert line["decoder_prompt_n"] <= 2
    assert rig.warnings() == []


async def test_a_remembered_refusal_asks_the_decoder_no_more_until_it_restarts(rig: RouteRig) -> None:
    rig.control.set(decoder=DecoderModes(kvshare_refuse=True))
    config = rig.config()
    await trio.Path(config.model.path).write_bytes(HYBRID_GGUF)
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, client_for(running, timeout=TIMEOUT) as client:
            decoder = running.daemon.models.default.decoder
            assert await complete(client) == plain_reply()
            assert len(rig.decoder("share")) == 1
            # The decoder would share now; the refusal is remembered for its process all the same.
            rig.control.set(decoder=DecoderModes())
            for _ in range(2):
                assert await complete(client) == plain_reply()
            assert len(rig.decoder("share")) == 1
            lines = await rig.route_lines.until(3)
            # Every request the refusal sent to the file route names the decoder's memory layout.
            assert [(line["route"], line["fallback"], line["memory"]) for line in lines] == [
                ("file", "share-refused", "kv+recurrent"),
                ("file", "share-refused-earlier", "kv+recurrent"),
                ("file", "share-refused-earlier", "kv+recurrent"),
            ]
            assert all(line["decoder_prompt_n"] <= 2 for line in lines)
            told = "hybrid: this decoder refused to share its KV; the state-file route is used until it restarts"
            assert rig.hybrid().count(told) == 1
            # Said per model while it holds: in /health and in the status onebitctl renders.
            model = running.daemon.models.default
            refused = (await client.get("/health")).json()["share_refused"]
            assert list(refused) == [model.name]
            assert refused[model.name].endswith("this decoder cannot share its KV (memory kv+recurrent)")
            assert model.statistics().share_refused == refused[model.name]
            said = render.render_status(running.daemon.statistics()).splitlines()
            assert f"share route refused: {refused[model.name]}" in next(x for x in said if x.startswith("restores "))

            pid, generation = decoder.pid, decoder.generation
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            while not (decoder.generation > generation and decoder.state is ChildState.READY):
                await decoder.wait_state(*(s for s in ChildState if s is not decoder.state))
            assert await complete(client) == plain_reply()
            line = (await rig.route_lines.until(4))[3]
            assert "share_refused" not in (await client.get("/health")).json()
            assert model.statistics().share_refused == ""
    assert len(rig.decoder("share")) == 2
    assert (line["route"], line["fallback"], line["memory"]) == ("share", None, None)


async def test_a_client_gone_during_the_shared_prefill_kills_the_provider_and_leaves_nothing(rig: RouteRig) -> None:
    rig.control.set(share=ShareModes(hang=True))
    with trio.fail_after(TIMEOUT):
        async with run_daemon(rig.config()) as running:
            # Hang up once the provider wrote into the region, while it still holds it.
            await hang_up_when(running, BODY, lambda: len(rig.control.written()) == 1)
            [line] = await rig.route_lines.until(1)
            assert (line["outcome"], line["status"]) == ("cancelled", 499)
            assert running.daemon.models.default.parts.slots.statistics().busy == 0
            assert running.daemon.models.default.parts.providers.all[0].busy == 0
            [pid] = rig.provider_pids()
            assert reaped(pid)
            assert rig.leftovers() == []
            assert rig.decoder("adopt") == []
            assert rig.decoder("completion") == []


async def test_a_slot_whose_shared_prefill_was_abandoned_is_erased_before_it_serves_again(rig: RouteRig) -> None:
    short = "pack my box"  # under min_prompt_tokens: the plain route
    # One slot: the abandoned share lands on the slot the short prompt left its cells in.
    with trio.fail_after(TIMEOUT):
        config = with_model(rig.config(), parallel=1)
        async with run_daemon(config) as running, client_for(running, timeout=TIMEOUT) as client:
            assert await complete(client, short) == plain_reply(short)
            rig.control.set(share=ShareModes(hang=True))
            await hang_up_when(running, BODY, lambda: len(rig.control.written()) == 1)
            first, cancelled = await rig.route_lines.until(2)
            assert first["slot"] == cancelled["slot"]
            assert cancelled["outcome"] == "cancelled"
            # The provider's rows overwrote the cells the short prompt left in that slot; were they
            # kept, the next request with that prefix would be answered from the abandoned prompt.
            rig.control.set(share=ShareModes())
            assert await complete(client, short) == plain_reply(short)
    [erase] = rig.decoder("erase")
    assert erase["slot"] == cancelled["slot"]
    assert rig.decoder("adopt") == []


# -- no leak --------------------------------------------------------------------------------------

# One round of the mix: (the provider's modes, does the decoder adopt?), each step two requests.
ROUND: list[tuple[ShareModes, bool]] = [
    (ShareModes(), True),
    (ShareModes(short=True), True),
    (ShareModes(), False),
    (ShareModes(negative=True), True),
    (ShareModes(garbage=True), True),
    (ShareModes(crash=True), True),
    (ShareModes(), True),
    (ShareModes(), True),
]


async def test_two_hundred_share_requests_with_mixed_failures_leave_no_fd_and_no_file_behind(rig: RouteRig) -> None:
    async def one_round(client: httpx.AsyncClient, *, handshake_fails: bool = False) -> None:
        for modes, adopts in ROUND:
            rig.control.set(
                share=modes, decoder=DecoderModes(kvshare_adopt_refuse=not adopts, kvshare_bad_header=handshake_fails)
            )
            # Two at a time, one per decoder slot: two cores start two providers at once.
            async with trio.open_nursery() as nursery:
                for _ in range(2):
                    nursery.start_soon(one, client)

    async def one(client: httpx.AsyncClient) -> None:
        assert await complete(client, PROMPT, 1) == plain_reply(PROMPT, 1)

    with trio.fail_after(120):
        # No health check during the run: it would add a connection to the decoder now and then.
        config = rig.config(health_interval_s=3600)
        async with run_daemon(config) as running, client_for(running, timeout=TIMEOUT) as client:
            await one_round(client)
            fds_before, files_before = open_fds(), sorted(os.listdir(rig.runtime))
            for i in range(13):
                # Halfway, a handshake fails: the rest go the state-file route, which must not leak either.
                await one_round(client, handshake_fails=i == 6)
            fds_after, files_after = open_fds(), sorted(os.listdir(rig.runtime))
            lines = await rig.route_lines.until(16 * 14)
    routes = {(line["route"], line["fallback"]) for line in lines}
    assert {("share", None), ("plain", "adopt-refused"), ("file", "share-refused-earlier")} <= routes

    def pooled(fds: list[str]) -> list[str]:
        # onebitd's keep-alive connections to the decoder: httpx's pool keeps one per request that
        # ran at the same time as another (two slots here), however the requests interleaved.
        return [fd for fd in fds if fd.endswith(f"-> {str(rig.runtime / 'decoder.sock')!r}")]

    assert [fd for fd in fds_after if fd not in pooled(fds_after)] == [
        fd for fd in fds_before if fd not in pooled(fds_before)
    ]
    assert 1 <= len(pooled(fds_after)) <= 2
    assert files_after == files_before
    assert rig.leftovers() == []


def test_a_header_naming_rows_no_provider_can_write_is_refused_at_the_handshake() -> None:
    # A provider skips the rows it does not know, and the decoder would decode from them unwritten: the
    # handshake refuses, before any provider runs, so the state-file route may still take the request.
    tensor = {"name": "cache_x_l0", "kind": "x", "region": 0, "offset": 0, "row_bytes": 16}
    header = json.dumps({"regions": [{"size": 4096}], "tensors": [tensor]}).encode()
    with pytest.raises(ShareRefused, match="kind 'x', which no provider here can write"):
        parse_header(header, [-1])
    tensor["kind"] = "s"  # a hybrid's recurrent state row is one a provider writes
    assert parse_header(json.dumps({"regions": [{"size": 4096}], "tensors": [tensor]}).encode(), [-1])
