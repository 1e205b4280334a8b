"""The HTTP front and the plain route, end to end against tests/fakes/llama/process.py.

Each test runs onebitd in-process (``run_daemon``) with the fake decoder as its child, talks to it with
httpx, and steers the fake through its control file: ``hold`` pauses a completion after its first
streamed token until the test lets go, so every "while it is in flight" below is an event, not a delay.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import trio
import trio.testing

from supervisor.models.model import ModelState
from supervisor.supervise.child import ChildState
from tests.rigs.helpers import (
    CHAT,
    HeldStream,
    assert_decoder_error,
    assert_envelope,
    chat,
    client_for,
    open_events,
    open_raw,
    receive_until,
    request_head,
    streamed_text,
    wait_queued,
    wait_until,
    with_model,
)
from tests.rigs.rig import Control, DecoderModes, RouteLines, fake_decoder_config, run_daemon

TIMEOUT = 20  # seconds; a test that needs more is stuck, not slow


# -- bad requests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [b"this is not json", b"[1, 2, 3]", b'"a string"'])
async def test_a_body_that_is_not_a_json_object_is_refused_with_400(
    short_dir: Path, control: Control, body: bytes
) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            reply = await client.post(CHAT, content=body, headers={"content-type": "application/json"})
            error = assert_envelope(reply, 400)
            assert error["code"] == "bad_json"
    assert control.entries() == []


async def _chunks(data: bytes, size: int = 256) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


@pytest.mark.parametrize("chunked", [False, True], ids=["content_length", "chunked"])
async def test_a_body_over_max_body_bytes_is_refused_with_413(short_dir: Path, control: Control, chunked: bool) -> None:
    config = fake_decoder_config(short_dir, server={"max_body_bytes": 1024})
    # Valid JSON that the decoder would gladly answer: only its size is wrong.
    body = json.dumps(chat("word " * 400)).encode()
    assert len(body) > 1024
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, client_for(running) as client:
            content: bytes | AsyncIterator[bytes] = _chunks(body) if chunked else body
            reply = await client.post(CHAT, content=content)
            error = assert_envelope(reply, 413)
            assert error["code"] == "body_too_large"
            # Just under the limit is fine.
            small = await client.post(CHAT, json=chat("word " * 100))
            assert small.status_code == 200
    assert len(control.entries()) == 1


async def test_a_declared_oversized_body_is_refused_before_it_is_sent(short_dir: Path, control: Control) -> None:
    config = fake_decoder_config(short_dir, server={"max_body_bytes": 1024})
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, await open_raw(running) as raw:
            # Headers only: were onebitd to wait for a gigabyte, fail_after would end the test.
            await raw.send_all(request_head(CHAT, 1_000_000_000))
            received = bytearray()
            await receive_until(raw, received, b"\r\n\r\n")
            head, _, rest = bytes(received).partition(b"\r\n\r\n")
            status_line, *header_lines = head.decode().split("\r\n")
            assert status_line.split(" ")[1] == "413"
            headers = dict(line.lower().split(": ", 1) for line in header_lines)
            received = bytearray(rest)
            while len(received) < int(headers["content-length"]):
                received += await raw.receive_some()
    assert json.loads(received)["error"]["code"] == "body_too_large"


async def test_an_unknown_path_is_404_and_a_wrong_method_is_405(short_dir: Path, control: Control) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            assert assert_envelope(await client.get("/no/such/thing"), 404)["code"] == "not_found"
            assert assert_envelope(await client.post("/v2/chat"), 404)["code"] == "not_found"
            for method, path in [
                ("GET", CHAT),
                ("POST", "/health"),
                ("POST", "/v1/models"),
                ("GET", "/tokenize"),
            ]:
                reply = await client.request(method, path)
                assert assert_envelope(reply, 405)["code"] == "method_not_allowed", (method, path)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_decoder_400_is_relayed_as_the_decoder_wrote_it(
    short_dir: Path, control: Control, route_lines: RouteLines, stream: bool
) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            # llama.cpp's native endpoint requires "prompt": only the decoder knows that.
            reply = await client.post("/completion", json={"n_predict": 3, "stream": stream})
            error = assert_decoder_error(reply, 400)
            assert "prompt" in error["message"]
            assert error["type"] == "invalid_request_error"
    [line] = route_lines.lines
    assert (line["status"], line["outcome"]) == (400, "error")


# -- who may ask ------------------------------------------------------------------------------------


async def test_a_loopback_bind_refuses_a_foreign_host_and_accepts_loopback_names(
    short_dir: Path, control: Control
) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            port = urlsplit(running.url).port
            for host in ("evil.example", f"evil.example:{port}", "10.1.2.3", "[2001:db8::1]:80"):
                reply = await client.get("/v1/models", headers={"host": host})
                assert assert_envelope(reply, 403)["code"] == "forbidden_host", host
                # /health too: a rebinding page must not even learn that onebitd is there.
                assert (await client.get("/health", headers={"host": host})).status_code == 403
            for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "[::1]"):
                reply = await client.get("/v1/models", headers={"host": host})
                assert reply.status_code == 200, host


async def test_a_loopback_bind_refuses_a_cross_site_origin_on_post(short_dir: Path, control: Control) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            for origin in ("https://evil.example", "http://evil.example:8080"):
                reply = await client.post(CHAT, json=chat("hi"), headers={"origin": origin})
                assert assert_envelope(reply, 403)["code"] == "cross_origin", origin
            for origin in ("http://localhost:5173", "http://127.0.0.1:8080", "http://[::1]:3000"):
                reply = await client.post(CHAT, json=chat("hi"), headers={"origin": origin})
                assert reply.status_code == 200, origin
    assert len(control.entries()) == 3


async def test_api_keys_are_required_everywhere_but_health(short_dir: Path, control: Control) -> None:
    config = fake_decoder_config(short_dir, server={"api_keys": ["first-key", "second-key"]})
    refused: list[dict[str, str]] = [
        {},
        {"authorization": "Bearer wrong-key"},
        {"x-api-key": "wrong-key"},
        # As llama-server: Authorization, when given, is the key; X-Api-Key is read only without it.
        {"authorization": "Bearer wrong-key", "x-api-key": "first-key"},
    ]
    accepted: list[dict[str, str]] = [
        {"authorization": "Bearer first-key"},
        {"authorization": "Bearer second-key"},
        {"authorization": "second-key"},  # llama-server takes the key without "Bearer " too
        {"x-api-key": "first-key"},  # the Anthropic clients' header
    ]
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, client_for(running) as client:
            for headers in refused:
                reply = await client.post(CHAT, json=chat("hi"), headers=headers)
                error = assert_envelope(reply, 401)
                assert (error["code"], error["type"]) == ("invalid_api_key", "authentication_error")
                assert (await client.get("/v1/models", headers=headers)).status_code == 401
            for headers in accepted:
                reply = await client.post(CHAT, json=chat("hi"), headers=headers)
                assert reply.status_code == 200, headers
            for path in ("/health", "/v1/health"):
                health = await client.get(path)
                assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert len(control.entries()) == len(accepted)


# -- the decoder's state ----------------------------------------------------------------------------


async def test_health_says_loading_with_retry_after_until_the_decoder_is_ready(
    short_dir: Path, control: Control, route_lines: RouteLines
) -> None:
    control.set(decoder=DecoderModes(loading=True))
    config = fake_decoder_config(short_dir, server={"retry_after_s": 7})
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config, wait_ready=False) as running, client_for(running) as client:
            # The fake is up and answering "Loading model", not merely not started yet.
            await wait_until(lambda: bool(control.entries("start")))
            health = await client.get("/health")
            assert (health.status_code, health.json()) == (503, {"status": "loading"})
            assert health.headers["retry-after"] == "7"
            reply = await client.post(CHAT, json=chat("hi"))
            error = assert_envelope(reply, 503)
            assert error["code"] == "decoder_unavailable"
            assert reply.headers["retry-after"] == "7"
            control.set(decoder=DecoderModes())
            # Ready once its model is loaded: its slot context read and its restores probed.
            await running.daemon.models.default.wait_state(ModelState.LOADED)
            health = await client.get("/health")
            assert (health.status_code, health.json()) == (200, {"status": "ok"})
            assert "retry-after" not in health.headers
            assert (await client.post(CHAT, json=chat("hi"))).status_code == 200
    assert [line["status"] for line in route_lines.lines] == [503, 200]


async def test_a_failed_decoder_makes_health_say_failed_and_completions_fail_at_once(
    short_dir: Path, control: Control
) -> None:
    control.set(decoder=DecoderModes(exit=3))
    config = fake_decoder_config(
        short_dir, decoder={"restart": {"max_failures": 2, "backoff_initial_s": 0.01, "backoff_max_s": 0.01}}
    )
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config, wait_ready=False) as running, client_for(running) as client:
            await running.daemon.models.default.decoder.wait_state(ChildState.FAILED)
            assert len(control.entries("start")) == 2
            health = await client.get("/health")
            assert (health.status_code, health.json()) == (503, {"status": "failed"})
            assert "retry-after" in health.headers
            reply = await client.post(CHAT, json=chat("hi"))
            error = assert_envelope(reply, 503)
            assert "failed" in error["message"]
            assert "exit status 3" in error["message"]
            # Nothing restarts a failed decoder behind our back.
            assert len(control.entries("start")) == 2


# -- slots ------------------------------------------------------------------------------------------


async def test_every_request_is_pinned_to_a_slot_onebitd_allocated(
    short_dir: Path, control: Control, route_lines: RouteLines
) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            for endpoint, body in [
                (CHAT, chat("one")),
                ("/v1/completions", {"prompt": "two", "max_tokens": 2}),
                # A client's own id_slot is not trusted: onebitd owns the slots.
                ("/completion", {"prompt": "three", "n_predict": 2, "id_slot": 5}),
                (CHAT, chat("four", stream=True)),
            ]:
                assert (await client.post(endpoint, json=body)).status_code == 200
    entries = control.entries()
    assert len(entries) == 4
    assert [entry["id_slot"] for entry in entries] == [line["slot"] for line in route_lines.lines]
    assert all(entry["id_slot"] in (0, 1) for entry in entries)


async def test_concurrent_streams_never_share_a_slot_and_overflow_gets_503(
    short_dir: Path, control: Control, route_lines: RouteLines
) -> None:
    control.set(decoder=DecoderModes(hold=True))
    config = with_model(fake_decoder_config(short_dir, server={"queue_limit": 2}), parallel=2)
    with trio.fail_after(TIMEOUT):
        async with (
            run_daemon(config) as running,
            client_for(running) as client,
            trio.open_nursery() as nursery,
        ):
            slots = running.daemon.models.default.parts.slots
            streams = [HeldStream(client, f"stream {i}") for i in range(4)]
            for stream in streams[:2]:
                await nursery.start(stream.run)
            assert slots.statistics().busy == 2
            for queued, stream in enumerate(streams[2:], start=1):
                nursery.start_soon(stream.run)
                await wait_queued(slots, queued)
            reply = await client.post(CHAT, json=chat("one too many"))
            error = assert_envelope(reply, 503)
            assert error["code"] == "overloaded"
            assert reply.headers["retry-after"] == "1"
            control.set(decoder=DecoderModes())
    assert all(stream.status == 200 for stream in streams)
    assert all(stream.events[-1] == "[DONE]" for stream in streams)
    entries = sorted(control.entries(), key=lambda entry: entry["seq"])
    assert len(entries) == 4
    assert not any(entry["slot_busy"] for entry in entries)
    assert {entry["id_slot"] for entry in entries[:2]} == {0, 1}
    assert sorted(line["status"] for line in route_lines.lines) == [200, 200, 200, 200, 503]


async def test_queued_requests_are_served_in_arrival_order(short_dir: Path, control: Control) -> None:
    # Two held streams fill both slots; releasing one serves the queue one by one on the slot it frees.
    control.set(decoder=DecoderModes(hold=["held-a", "held-b"]))
    config = with_model(fake_decoder_config(short_dir, server={"queue_limit": 8}), parallel=2)
    with trio.fail_after(TIMEOUT):
        async with (
            run_daemon(config) as running,
            client_for(running) as client,
            trio.open_nursery() as nursery,
        ):
            slots = running.daemon.models.default.parts.slots
            held = [HeldStream(client, "held-a"), HeldStream(client, "held-b")]
            for stream in held:
                await nursery.start(stream.run)
            names = ["queued-1", "queued-2", "queued-3", "queued-4"]
            done = trio.Semaphore(0)

            async def ask(text: str) -> None:
                reply = await client.post(CHAT, json=chat(text))
                assert reply.status_code == 200
                done.release()

            for queued, name in enumerate(names, start=1):
                nursery.start_soon(ask, name)
                await wait_queued(slots, queued)
            control.set(decoder=DecoderModes(hold=["held-b"]))
            for _ in names:
                await done.acquire()
            control.set(decoder=DecoderModes())
    by_arrival = sorted(control.entries(), key=lambda entry: entry["seq"])
    served = [name for entry in by_arrival for name in names if name in entry["prompt"]]
    assert served == names
    # One after the other, on the slot "held-a" freed.
    assert len({entry["slot"] for entry in by_arrival if "queued" in entry["prompt"]}) == 1


# -- streaming --------------------------------------------------------------------------------------


async def test_a_stream_is_relayed_chunk_by_chunk(short_dir: Path, control: Control) -> None:
    control.set(decoder=DecoderModes(hold=True))
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            body = chat("alpha beta gamma", stream=True, max_tokens=3)
            async with open_events(client, CHAT, body) as (reply, events):
                assert reply.status_code == 200
                assert reply.headers["content-type"].startswith("text/event-stream")
                role = json.loads(await anext(events))
                assert role["choices"][0]["delta"]["role"] == "assistant"
                # The fake is holding its remaining tokens: this one came through on its own.
                first = json.loads(await anext(events))
                assert first["choices"][0]["delta"]["content"] == "alpha"
                assert control.entries() == []
                control.set(decoder=DecoderModes())
                rest = [data async for data in events]
    assert streamed_text([json.dumps(first), *rest]) == "alpha beta gamma"
    assert rest[-1] == "[DONE]"
    assert "timings" in json.loads(rest[-2])


@pytest.mark.parametrize(
    ("endpoint", "body", "text"),
    [
        (CHAT, chat("red green", max_tokens=3), "red green red"),
        ("/v1/completions", {"prompt": "red green", "max_tokens": 3}, " red green red"),
        ("/completion", {"prompt": "red green", "n_predict": 3}, " red green red"),
    ],
    ids=["chat", "completions", "native"],
)
async def test_a_whole_reply_is_relayed_as_the_decoder_sent_it(
    short_dir: Path, control: Control, endpoint: str, body: dict[str, Any], text: str
) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            reply = await client.post(endpoint, json=body)
    assert reply.status_code == 200
    data = reply.json()
    if endpoint == CHAT:
        assert data["choices"][0]["message"]["content"] == text
    elif endpoint == "/v1/completions":
        assert data["choices"][0]["text"] == text
    else:
        assert data["content"] == text
    assert data["timings"]["predicted_n"] == 3


async def test_pass_through_endpoints_reach_the_decoder(short_dir: Path, control: Control) -> None:
    config = with_model(fake_decoder_config(short_dir), alias="fake-model")
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, client_for(running) as client:
            models = await client.get("/v1/models")
            assert [model["id"] for model in models.json()["data"]] == ["fake-model"]
            tokens = (await client.post("/tokenize", json={"content": "hello there"})).json()["tokens"]
            assert len(tokens) == 2
            text = await client.post("/detokenize", json={"tokens": tokens})
            assert text.json() == {"content": "hello there"}
            template = await client.post("/apply-template", json={"messages": [{"role": "user", "content": "hi"}]})
            assert "hi" in template.json()["prompt"]
            bad = await client.post("/detokenize", json={"tokens": "not a list"})
            assert_decoder_error(bad, 400)
    assert control.entries() == []  # none of these is a completion: no slot was taken


# -- route lines ------------------------------------------------------------------------------------


async def test_each_completion_logs_exactly_one_route_line(
    short_dir: Path, control: Control, route_lines: RouteLines
) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            assert (await client.post(CHAT, json=chat("one two three"))).status_code == 200
            async with client.stream("POST", "/v1/completions", json={"prompt": "a b", "stream": True}) as reply:
                assert reply.status_code == 200
                await reply.aread()
            assert (await client.get("/health")).status_code == 200  # not a completion: no line
    entries = control.entries()
    lines = route_lines.lines
    assert [line["endpoint"] for line in lines] == [CHAT, "/v1/completions"]
    for line, entry in zip(lines, entries, strict=True):
        assert (line["route"], line["status"], line["outcome"], line["error"]) == ("plain", 200, "ok", None)
        assert line["slot"] == entry["id_slot"]
        assert line["req"]
        assert line["first_byte_ms"] is not None
        assert line["total_ms"] is not None
    # The numbers come from the decoder's own timings, streamed or whole.
    chat_tokens = len(entries[0]["prompt"].split())
    assert (lines[0]["decoder_prompt_n"], lines[0]["prompt_tokens"]) == (chat_tokens, chat_tokens)
    assert (lines[1]["decoder_prompt_n"], lines[1]["prompt_tokens"]) == (2, 2)
    assert lines[0]["req"] != lines[1]["req"]


async def test_a_completion_request_refused_before_it_starts_still_logs_one_route_line(
    short_dir: Path, control: Control, route_lines: RouteLines
) -> None:
    config = fake_decoder_config(short_dir, server={"api_keys": ["key"], "max_body_bytes": 1024})
    key = {"authorization": "Bearer key"}
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, client_for(running) as client:
            refused = [
                await client.post(CHAT, content=b"not json", headers=key),
                await client.post("/v1/completions", json={"prompt": "x" * 2000}, headers=key),
                await client.post("/completion", json={"prompt": "no key"}),
                await client.get(CHAT, headers=key),
            ]
            assert [reply.status_code for reply in refused] == [400, 413, 401, 405]
            await client.get("/v1/models", headers=key)  # not a completion: no line
    lines = route_lines.lines
    assert [(line["endpoint"], line["status"], line["outcome"]) for line in lines] == [
        (CHAT, 400, "error"),
        ("/v1/completions", 413, "error"),
        ("/completion", 401, "error"),
        (CHAT, 405, "error"),
    ]
    assert all(line["route"] == "plain" and line["error"] and line["slot"] is None for line in lines)
    assert len({line["req"] for line in lines}) == 4
    assert control.entries() == []


async def test_a_client_that_disconnects_mid_stream_closes_the_upstream_request_and_frees_its_slot(
    short_dir: Path, control: Control, route_lines: RouteLines
) -> None:
    control.set(decoder=DecoderModes(hold=True))
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            # A bare socket: httpx leaves unclosed generators behind when a stream is abandoned.
            body = json.dumps(chat("going going gone", stream=True)).encode()
            async with await open_raw(running) as raw:
                await raw.send_all(request_head(CHAT, len(body)) + body)
                await receive_until(raw, bytearray(), b'"content":"going"')
                assert running.daemon.models.default.parts.slots.statistics().busy == 1
            # Leaving the block closed the connection mid-stream.
            [line] = await route_lines.until(1)
            assert (line["route"], line["outcome"], line["status"]) == ("plain", "cancelled", 200)
            assert running.daemon.models.default.parts.slots.statistics().busy == 0
            [entry] = await control.wait_entries(1)
            assert entry["disconnected"] is True
            assert entry["finished"] is False
            control.set(decoder=DecoderModes())
            # The slot really is free: the next request gets it at once.
            assert (await client.post(CHAT, json=chat("next"))).status_code == 200
    assert len(route_lines.lines) == 2


async def test_a_client_that_leaves_the_queue_is_cancelled_without_reaching_the_decoder(
    short_dir: Path, control: Control, route_lines: RouteLines
) -> None:
    control.set(decoder=DecoderModes(hold=True))
    config = with_model(fake_decoder_config(short_dir), parallel=1)
    with trio.fail_after(TIMEOUT):
        async with (
            run_daemon(config) as running,
            client_for(running) as client,
            trio.open_nursery() as nursery,
        ):
            slots = running.daemon.models.default.parts.slots
            held = HeldStream(client, "holding the only slot")
            await nursery.start(held.run)
            waiting = trio.CancelScope()

            async def wait_in_queue() -> None:
                with waiting:
                    await client.post(CHAT, json=chat("impatient"))

            nursery.start_soon(wait_in_queue)
            await wait_queued(slots, 1)
            waiting.cancel()  # the client hangs up
            [line] = await route_lines.until(1)
            assert (line["outcome"], line["status"], line["slot"]) == ("cancelled", 499, None)
            assert slots.statistics().queued == 0
            control.set(decoder=DecoderModes())
    [entry] = control.entries()
    assert "impatient" not in entry["prompt"]


# -- the decoder dies, onebitd stops ---------------------------------------------------------------


async def test_a_decoder_killed_mid_stream_ends_the_stream_with_an_error_event_and_is_restarted(
    short_dir: Path, control: Control, route_lines: RouteLines
) -> None:
    control.set(decoder=DecoderModes(hold=True))
    config = fake_decoder_config(short_dir, decoder={"restart": {"backoff_initial_s": 0.01}})
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, client_for(running) as client:
            decoder = running.daemon.models.default.decoder
            pid = decoder.pid
            assert pid is not None
            async with open_events(client, CHAT, chat("doomed", stream=True)) as (_reply, events):
                await anext(events)  # the role
                await anext(events)  # the first token
                os.kill(pid, signal.SIGKILL)
                # After the kill, not before: a decoder that saw hold=False first would finish the stream.
                control.set(decoder=DecoderModes())
                rest = [data async for data in events]
            error = json.loads(rest[-1])["error"]
            assert (error["source"], error["code"]) == ("decoder", "decoder_lost")
            assert "[DONE]" not in rest
            [line] = await route_lines.until(1)
            assert (line["outcome"], line["status"]) == ("error", 200)
            assert running.daemon.models.default.parts.slots.statistics().busy == 0

            await wait_until(lambda: decoder.statistics().restarts == 1 and decoder.state is ChildState.READY)
            assert decoder.pid not in (None, pid)
            reply = await client.post(CHAT, json=chat("again"))
            assert reply.status_code == 200
            assert reply.json()["choices"][0]["message"]["content"] == "again again again again"
    assert [line["outcome"] for line in route_lines.lines] == ["error", "ok"]


async def test_a_stream_in_flight_at_shutdown_finishes_its_reply(
    short_dir: Path, control: Control, route_lines: RouteLines
) -> None:
    control.set(decoder=DecoderModes(hold=True))
    with trio.fail_after(TIMEOUT):
        async with (
            run_daemon(fake_decoder_config(short_dir)) as running,
            client_for(running) as client,
            open_events(client, CHAT, chat("last words", stream=True)) as (_reply, events),
        ):
            await anext(events)  # the role
            first = await anext(events)
            running.daemon.request_stop()
            await wait_until(lambda: running.daemon.front.draining)
            await trio.testing.wait_all_tasks_blocked()
            control.set(decoder=DecoderModes())
            rest = [data async for data in events]
    assert streamed_text([first, *rest]) == "last words last words"
    assert rest[-1] == "[DONE]"
    [line] = route_lines.lines
    assert (line["outcome"], line["status"]) == ("ok", 200)


# -- header names -----------------------------------------------------------------------------------


async def _raw_exchange(raw: trio.SocketStream, request: bytes) -> bytes:
    """One request on a raw connection; the reply's head, byte for byte."""
    await raw.send_all(request)
    received = bytearray()
    await receive_until(raw, received, b"\r\n\r\n")
    head, _, rest = bytes(received).partition(b"\r\n\r\n")
    if b"\r\nContent-Length: " in head:
        length = int(head.split(b"\r\nContent-Length: ", 1)[1].split(b"\r\n", 1)[0])
        while len(rest) < length:
            rest += await raw.receive_some()
    else:
        while not rest.endswith(b"0\r\n\r\n"):
            rest += await raw.receive_some()
    return head + b"\r\n"


async def test_header_names_go_out_in_the_case_llama_server_writes_them(short_dir: Path) -> None:
    # A client that indexes a plain dict of the headers (dict(r.headers)["Access-Control-Allow-Origin"])
    # finds what it finds straight from llama-server.
    config = fake_decoder_config(short_dir, server={"cors_origins": ["localhost"]})
    origin = b"Origin: http://localhost\r\n"
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, await open_raw(running) as raw:
            preflight = await _raw_exchange(
                raw,
                b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                + origin
                + b"Access-Control-Request-Method: POST\r\n\r\n",
            )
            body = json.dumps(chat("hi")).encode()
            whole = await _raw_exchange(raw, request_head(CHAT, len(body))[:-2] + origin + b"\r\n" + body)
            streamed_body = json.dumps({**chat("hi"), "stream": True}).encode()
            streamed = await _raw_exchange(raw, request_head(CHAT, len(streamed_body)) + streamed_body)
            running.daemon.front.registry.drain()
            health = await _raw_exchange(raw, b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    for name in (b"Access-Control-Allow-Origin", b"Access-Control-Allow-Methods", b"Access-Control-Allow-Headers"):
        assert b"\r\n" + name + b": " in preflight, preflight
    for name in (b"Content-Type", b"Content-Length", b"Date", b"X-Onebit-Source", b"Access-Control-Allow-Origin"):
        assert b"\r\n" + name + b": " in whole, whole
    assert b"\r\nX-Onebit-Source: decoder\r\n" in whole
    for name in (b"Content-Type", b"Cache-Control", b"X-Accel-Buffering", b"Transfer-Encoding"):
        assert b"\r\n" + name + b": " in streamed, streamed
    assert b"\r\nRetry-After: " in health, health
    assert b"\r\nX-Onebit-Source: onebitd\r\n" in health, health
