"""Resumable streams through ``Front``, in process, against tests/fakes/llama/inprocess.py: ``X-Conversation-Id``
is passed on, a hang-up mid-stream detaches the request instead of cancelling it (its slot held
until the decoder's stream ends, or ``server.detach_timeout_s``), and the three stream endpoints are
relayed.  tests/real/test_real_streams.py asks the same of the real llama-server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from supervisor.api.front import Front
from supervisor.api.serving import One
from supervisor.config import HybridConfig, ServerConfig
from supervisor.http.server import HttpServer
from supervisor.llama.slots import SlotPool
from supervisor.observe.metrics import Metrics
from supervisor.routeline import RequestOutcome, RouteLine
from supervisor.routes.completion import Completions
from tests.fakes.llama.core import Modes
from tests.fakes.llama.inprocess import FakeLlama
from tests.rigs import asgi
from tests.rigs.asgi import ReadyDecoder

TIMEOUT = 10
CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "one two three"}], "max_tokens": 3, "stream": True}
CONVERSATION = {"x-conversation-id": "conv-1"}


class Rig:
    def __init__(self, tmp_path: Path, **server: Any) -> None:
        self.fake = FakeLlama(tmp_path)
        client = self.fake.client()
        decoder = ReadyDecoder()
        self.slots = SlotPool(2, 8)
        completions = Completions(
            decoder=decoder, client=client, slots=self.slots, settings=HybridConfig(enabled=False)
        )
        self.lines: list[RouteLine] = []
        self.front = Front(ServerConfig(**server), One(completions, client, decoder), emit=self.lines.append)


async def test_a_conversation_id_is_passed_on_to_the_decoder(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    with trio.fail_after(TIMEOUT):
        reply = await asgi.call(rig.front, "POST", CHAT, BODY, CONVERSATION)
        plain = await asgi.call(rig.front, "POST", CHAT, BODY)
    assert reply.status == plain.status == 200
    assert [heard for heard in rig.fake.heard if heard[1] == CHAT] == [("POST", CHAT, "conv-1"), ("POST", CHAT, None)]
    assert [line.outcome for line in rig.lines] == ["ok", "ok"]


async def test_a_stream_with_a_conversation_id_left_mid_way_runs_to_its_end_holding_its_slot(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.fake.modes = Modes(hold=True)  # the reply pauses after its first token: the client leaves then
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: asgi.call(rig.front, "POST", CHAT, BODY, CONVERSATION, hang_up_on=b"data: "))
            await trio.testing.wait_all_tasks_blocked()
            # The client is gone; the decoder's request is not, nor is the slot it runs on.
            assert rig.lines == []
            assert rig.slots.statistics().busy == 1
            # Still in flight: a drain waits for it, `onebitctl status` shows it.
            assert [request.endpoint for request in rig.front.registry.statistics().inflight] == [CHAT]
            rig.fake.release.set()
    [line] = rig.lines
    assert (line.outcome, line.status, line.error) == ("detached", 200, None)
    assert line.decoder_prompt_n is not None  # the final event was read after the hang-up
    assert rig.slots.statistics().busy == 0
    assert ("DELETE", "/v1/stream", None) not in rig.fake.heard


async def test_a_hang_up_before_the_reply_began_cancels_as_llama_server_does(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    rig = Rig(tmp_path)
    rig.fake.modes = Modes(hang=True)  # no head yet: llama-server answers once the prompt is evaluated
    with trio.fail_after(TIMEOUT):
        reply = await asgi.call(rig.front, "POST", CHAT, BODY, CONVERSATION, hang_up_after_s=1)
    assert reply.status == 0
    [line] = rig.lines
    assert (line.outcome, line.status) == ("cancelled", 499)
    assert rig.slots.statistics().busy == 0


async def test_a_detached_stream_past_its_bound_is_stopped_and_its_slot_freed(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    rig = Rig(tmp_path, detach_timeout_s=30)
    rig.fake.modes = Modes(hold=True)  # and never released: only the bound ends it
    with trio.fail_after(TIMEOUT * 10):
        await asgi.call(rig.front, "POST", CHAT, BODY, CONVERSATION, hang_up_on=b"data: ")
    [line] = rig.lines
    assert line.outcome == "detached"
    assert line.error == "the detached stream ran past server.detach_timeout_s (30s); stopped"
    assert ("DELETE", "/v1/stream", None) in rig.fake.heard
    assert ("/v1/stream", "conv_id=conv-1", {}) in rig.fake.seen
    assert rig.slots.statistics().busy == 0


async def test_a_stream_without_a_conversation_id_left_mid_way_is_cancelled(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.fake.modes = Modes(hold=True)
    with trio.fail_after(TIMEOUT):
        await asgi.call(rig.front, "POST", CHAT, BODY, hang_up_on=b"data: ")
    [line] = rig.lines
    assert line.outcome == "cancelled"
    assert rig.slots.statistics().busy == 0


def test_detached_is_counted_in_metrics_like_any_outcome() -> None:
    metrics = Metrics(lambda: pytest.fail("no live statistics are asked for here"))
    metrics.observe(RouteLine(req="r", endpoint=CHAT, outcome=RequestOutcome.DETACHED, status=200, first_byte_ms=5.0))
    [family] = metrics.requests.collect()
    counted = {sample.labels["outcome"]: sample.value for sample in family.samples if sample.name.endswith("_total")}
    assert counted == {"detached": 1.0}
    # It was served: its first byte counts among the served requests' latencies.
    [latency] = metrics.first_byte.collect()
    assert [s.value for s in latency.samples if s.name.endswith("_count")] == [1.0]


@pytest.mark.parametrize("value", ["conv\x01id", "caf\u00e9"])
async def test_a_conversation_id_that_is_not_visible_ascii_is_refused_in_onebitds_shape(
    tmp_path: Path, value: str
) -> None:
    rig = Rig(tmp_path)
    with trio.fail_after(TIMEOUT):
        reply = await asgi.call(rig.front, "POST", CHAT, BODY, {"x-conversation-id": value})
    assert reply.status == 400
    assert reply.json()["error"]["code"] == "bad_conversation_id"
    assert [request for request in rig.fake.heard if request[1] == CHAT] == []


# -- the three stream endpoints ---------------------------------------------------------------------


async def test_a_replay_is_relayed_as_it_comes_and_a_hang_up_closes_it(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            replies: list[asgi.Reply] = []

            async def replay() -> None:
                replies.append(await asgi.call(rig.front, "GET", "/v1/stream", query="conv_id=live&from=0"))

            nursery.start_soon(replay)
            await trio.testing.wait_all_tasks_blocked()
            rig.fake.release.set()
    [reply] = replies
    assert (reply.status, reply.headers["content-type"], reply.headers["x-onebit-source"]) == (
        200,
        "text/event-stream",
        "decoder",
    )
    assert reply.chunks[:2] == [b'data: {"n": 1}\n\n', b"data: [DONE]\n\n"]
    assert ("/v1/stream", "conv_id=live&from=0", {}) in rig.fake.seen
    assert rig.lines == []  # no slot, no route line


async def test_a_replay_asked_with_a_body_that_never_comes_is_relayed_whole(tmp_path: Path) -> None:
    # Through onebitd's server: the replay does not read the GET's body, so the body's deadline
    # (here all but at once) is the server's to keep when it drops the body after the reply, and
    # never cuts the stream.
    rig = Rig(tmp_path)
    stop = trio.Event()
    server = HttpServer(
        rig.front, hosts=("127.0.0.1",), port=0, idle_timeout_s=TIMEOUT, shutdown=stop.wait, body_timeout_s=0.001
    )
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            [url] = await nursery.start(server.run)
            stream = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
            async with stream:
                await stream.send_all(
                    b"GET /v1/stream?conv_id=live&from=0 HTTP/1.1\r\nHost: localhost\r\nContent-Length: 10\r\n\r\nabc"
                )
                received = b""
                while b"\r\n\r\n" not in received:
                    received += await stream.receive_some()
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)  # the body's deadline is long past
                rig.fake.release.set()
                while data := await stream.receive_some():
                    received += data
            stop.set()
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b'data: {"n": 1}' in body
    assert body.endswith(b"0\r\n\r\n")  # the chunked reply's end: whole, then the connection closed


async def test_a_replay_of_an_unknown_conversation_is_the_decoders_404(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    with trio.fail_after(TIMEOUT):
        reply = await asgi.call(rig.front, "GET", "/v1/stream", query="conv_id=gone")
    assert (reply.status, reply.headers["x-onebit-source"]) == (404, "decoder")
    assert reply.json()["error"]["message"] == "Stream not found or expired"


async def test_a_lookup_and_a_stop_are_relayed(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    with trio.fail_after(TIMEOUT):
        found = await asgi.call(rig.front, "POST", "/v1/streams/lookup", {"conversation_ids": ["a"]})
        stopped = await asgi.call(rig.front, "DELETE", "/v1/stream", query="conv_id=a%3A%3Am")
    assert (found.status, found.json()) == (200, [])
    assert (stopped.status, stopped.body) == (204, b"")
    assert ("/v1/stream", "conv_id=a%3A%3Am", {}) in rig.fake.seen


async def test_a_query_string_that_is_not_visible_ascii_is_refused(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    with trio.fail_after(TIMEOUT):
        reply = await asgi.call(rig.front, "GET", "/v1/stream", query="conv_id=a b")
    assert (reply.status, reply.json()["error"]["code"]) == (400, "bad_query")
    assert [seen for seen in rig.fake.seen if seen[0] == "/v1/stream"] == []
