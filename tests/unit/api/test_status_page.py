"""The status page's endpoints (supervisor/api/statuspage.py) on a daemon with tests/fakes/llama/process.py:
the page's own files with their Content-Security-Policy, ``/onebit/status`` as the admin ``status``
verb answers, ``/onebit/events`` as the ``watch`` feed, the API's rules (Host, key, no CORS), and a
feed reader that stops reading dropped at its bound while other requests go on.

tests/real/test_real_status_page.py runs the page itself in a real browser against the real decoder.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from supervisor.admin import verbs as admin
from supervisor.api import statuspage
from supervisor.testing import Running
from tests.fakes import fake_provider
from tests.rigs.helpers import CHAT, assert_envelope, chat, client_for, open_raw, receive_until, wait_until
from tests.rigs.rig import Control, fake_decoder_config, run_daemon

TIMEOUT = 20  # seconds; a test that needs more is stuck, not slow
PAGE = "/onebit/"
KEY = {"authorization": "Bearer the-key"}
ADMIN = {"authorization": "Bearer the-admin-key"}


class Feed:
    """``/onebit/events`` read off a bare connection: its head, then its events one by one (httpx's
    line iterators, left unfinished, would be collected unclosed: the feed never ends)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()
        self.body = bytearray()  # the chunked body, de-chunked
        self.head = b""

    async def _more(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise EOFError("the feed ended")
        self.buffer += data

    async def open(self, headers: dict[str, str]) -> None:
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        await self.stream.send_all(f"GET {PAGE}events HTTP/1.1\r\nHost: localhost\r\n{extra}\r\n".encode())
        while b"\r\n\r\n" not in self.buffer:
            await self._more()
        end = self.buffer.index(b"\r\n\r\n") + 4
        self.head, self.buffer = bytes(self.buffer[:end]), self.buffer[end:]

    async def __anext__(self) -> dict[str, Any]:
        while b"\n\n" not in self.body:
            while b"\r\n" not in self.buffer:
                await self._more()
            size = int(self.buffer[: self.buffer.index(b"\r\n")], 16)
            start = self.buffer.index(b"\r\n") + 2
            while len(self.buffer) < start + size + 2:
                await self._more()
            self.body += self.buffer[start : start + size]
            del self.buffer[: start + size + 2]
        end = self.body.index(b"\n\n")
        frame, self.body = bytes(self.body[:end]).decode(), self.body[end + 2 :]
        data = [line[6:] for line in frame.split("\n") if line.startswith("data: ")]
        return json.loads(data[0]) if data else await anext(self)

    def __aiter__(self) -> Feed:
        return self


@asynccontextmanager
async def feed(running: Running, headers: dict[str, str] | None = None) -> AsyncIterator[Feed]:
    """The feed's events, parsed, as they come (its hello first); leaving the block hangs up."""
    async with await open_raw(running) as stream:
        reader = Feed(stream)
        await reader.open(headers or {})
        assert reader.head.startswith(b"HTTP/1.1 200 "), reader.head
        assert b"content-type: text/event-stream" in reader.head.lower()
        yield reader


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        (PAGE, "text/html; charset=utf-8"),
        (PAGE + "page.css", "text/css; charset=utf-8"),
        (PAGE + "page.js", "text/javascript; charset=utf-8"),
    ],
)
async def test_the_page_and_its_files_are_served_with_their_type_and_a_strict_csp(
    short_dir: Path, control: Control, path: str, content_type: str
) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            reply = await client.get(path)
    assert reply.status_code == 200
    assert reply.headers["content-type"] == content_type
    assert reply.headers["content-security-policy"] == statuspage.CSP
    assert "script-src 'self';" in statuspage.CSP
    assert "unsafe-inline" not in statuspage.CSP
    assert reply.headers["x-content-type-options"] == "nosniff"
    assert reply.content == statuspage.asset(statuspage.ASSETS[path.removeprefix(PAGE)][0])


async def test_the_page_loads_nothing_from_elsewhere_and_runs_no_inline_script() -> None:
    html = statuspage.asset("index.html").decode()
    assert "<script>" not in html
    assert "style=" not in html
    for attribute in ("src=", "href="):
        for value in html.split(attribute)[1:]:
            target = value.split('"')[1]
            assert target.startswith("/onebit/") or target.startswith("data:"), target
    assert "http" not in statuspage.asset("page.js").decode().replace("http://www.w3.org/2000/svg", "")


async def test_onebit_without_the_slash_is_the_page_too(short_dir: Path, control: Control) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            reply = await client.get("/onebit")
    assert reply.status_code == 200
    assert reply.content == statuspage.asset("index.html")


async def test_onebit_status_is_what_the_status_verb_answers(short_dir: Path, control: Control) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            assert (await client.post(CHAT, json=chat("hi"))).status_code == 200
            page = (await client.get(PAGE + "status")).json()
            verb = (await admin.call(running.daemon.admin.path, "status"))["result"]
    # The one figure that moves between the two asks.
    assert page["daemon"].pop("uptime_s") <= verb["daemon"].pop("uptime_s")
    assert page == verb
    assert page["routes"] == {"plain": 1}


async def test_status_says_each_slots_state_and_the_count_of_tokens_it_holds(short_dir: Path, control: Control) -> None:
    # A prompt the prefix store may keep (cache.min_tokens) is tokenized: its slot's count is known.
    config = fake_decoder_config(short_dir, cache={"min_tokens": 4})
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, client_for(running) as client:
            assert (await client.post(CHAT, json=chat("a prompt the store may keep"))).status_code == 200
            slots = running.daemon.models.default.parts.slots
            # Its slot is kept until the store has saved it (off the request's path), then free.
            await wait_until(lambda: all(s.state == "free" for s in slots.statistics().each))
            page = (await client.get(PAGE + "status")).json()
            prompt_tokens = running.daemon.route_stats.recent()[-1]["line"]["prompt_tokens"]
    [model] = page["models"]["models"]
    each = model["slots"]["each"]
    assert [(s["slot"], s["state"]) for s in each] == [(0, "free"), (1, "free")]
    assert sorted((s["tokens"] for s in each), key=lambda n: n or 0) == [None, prompt_tokens]
    assert page["slots"]["each"] == each  # one model: the daemon's slots are its own


async def test_the_feed_says_hello_with_the_last_lines_then_sends_each_route_line_as_it_ends(
    short_dir: Path, control: Control
) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            assert (await client.post(CHAT, json=chat("before"))).status_code == 200
            async with feed(running) as events:
                hello = await anext(events)
                assert running.daemon.route_stats.snapshot().watchers == 1
                assert (await client.post(CHAT, json=chat("after"))).status_code == 200
                line = await anext(events)
    assert hello["event"] == "hello"
    [earlier] = hello["recent"]
    assert (earlier["line"]["route"], earlier["line"]["outcome"]) == ("plain", "ok")
    assert line["event"] == "line"
    assert (line["line"]["endpoint"], line["line"]["route"], line["line"]["status"]) == (CHAT, "plain", 200)
    assert line["at"] >= earlier["at"]
    assert line["line"]["decoded_n"] > 0
    assert line["line"]["decode_ms"] > 0
    # No prompt or reply text: the route line's fields are numbers and names.
    assert "after" not in json.dumps(line)
    assert "before" not in json.dumps(hello)


async def test_the_feed_sends_the_prefix_stores_events(short_dir: Path, control: Control) -> None:
    """Each model's store tells its events to the feed (what they hold: tests/unit/prefix/test_prefix_store.py; on
    the real parts: tests/real/test_real_store.py).  The fake decoder's state files are no llama.cpp
    state, so its store keeps none: the store's own listener stands in for one here."""
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running:
            model = running.daemon.models.default
            assert model.store is not None
            async with feed(running) as events:
                assert (await anext(events))["event"] == "hello"
                model.store.on_event({"what": "evicted", "tokens": 300, "bytes": 4096, "origin_host": "h"})
                event = await anext(events)
    assert event == {
        "event": "store",
        "model": model.name,
        "what": "evicted",
        "tokens": 300,
        "bytes": 4096,
        "origin_host": "h",
    }


async def test_the_feed_sends_the_decoders_transitions(short_dir: Path, control: Control) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running:
            decoder = running.daemon.models.default.decoder
            async with feed(running) as events:
                await anext(events)  # hello
                assert decoder.pid is not None
                os.kill(decoder.pid, signal.SIGKILL)
                moves = []
                async for event in events:
                    if event["event"] == "child":
                        moves.append((event["child"], event["from"], event["to"]))
                        if event["to"] == "ready":
                            break
    assert moves[0][:2] == ("decoder", "ready")
    assert moves[-1] == ("decoder", "starting", "ready")
    assert any(to in ("backoff", "starting") for _child, _old, to in moves[:-1])


async def test_the_feed_sends_a_providers_transitions(short_dir: Path, control: Control) -> None:
    command = [sys.executable, str(fake_provider.PATH), "--worker"]
    worker = {"kind": "worker", "name": "npu0", "command": command, "fidelity_check": False}
    config = fake_decoder_config(short_dir, hybrid={"enabled": True}, provider=[worker])
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config, providers_ready=True) as running:
            (provider,) = running.daemon.models.default.parts.providers.all
            assert provider.child is not None
            async with feed(running) as events:
                await anext(events)  # hello
                assert provider.child.pid is not None
                os.kill(provider.child.pid, signal.SIGKILL)
                moves = []
                async for event in events:
                    if event["event"] == "child":
                        moves.append((event["model"], event["child"], event["from"], event["to"]))
                        if event["to"] == "ready":
                            break
    model = running.daemon.models.default.name
    assert moves[0][:3] == (model, "provider-npu0", "ready")
    assert moves[-1] == (model, "provider-npu0", "starting", "ready")


async def test_a_feed_reader_that_stops_reading_is_dropped_at_its_bound_and_requests_go_on(
    short_dir: Path, control: Control
) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            stats = running.daemon.route_stats
            raw = await open_raw(running)
            await raw.send_all(b"GET /onebit/events HTTP/1.1\r\nHost: localhost\r\n\r\n")
            head = bytearray()
            await receive_until(raw, head, b"event: hello")
            assert stats.snapshot().watchers == 1
            # The reader reads no more.  Events far larger than a route line fill the socket's
            # buffers, then the feed's channel; the event after its bound drops the reader.
            published = 0
            while stats.snapshot().watch_closed == 0:
                stats.publish({"event": "padding", "pad": "x" * 16384})
                published += 1
                # The feed writes all it can: until the socket's buffers are full, then it waits.
                await trio.testing.wait_all_tasks_blocked()
            assert stats.snapshot().watchers == 0
            # Nothing else waited for it: a request is served, and its line counted.
            assert (await client.post(CHAT, json=chat("hi"))).status_code == 200
            # The dropped reader's connection is closed (its response cut short), not left open.
            with trio.move_on_after(TIMEOUT / 2) as never_closed:
                while await raw.receive_some(65536):
                    pass
            await raw.aclose()
            status = (await client.get(PAGE + "status")).json()
    assert not never_closed.cancelled_caught
    assert published > statuspage.FEED_BOUND
    assert (status["watch_closed"], status["watchers"], status["routes"]) == (1, 0, {"plain": 1})


@pytest.mark.parametrize("path", ["/onebit/x", "/onebit/status/", "/onebit/page.js.map", "/onebit/index.html"])
async def test_an_unknown_onebit_path_is_404_in_the_api_error_shape(
    short_dir: Path, control: Control, path: str
) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            reply = await client.get(path)
            post = await client.post(PAGE + "status")
    assert assert_envelope(reply, 404)["code"] == "not_found"
    assert assert_envelope(post, 405)["code"] == "method_not_allowed"


@pytest.mark.parametrize(
    ("admin_keys", "key", "refused"),
    [
        ([], KEY, (401, "invalid_api_key")),
        # With admin keys a loopback client needs one too, and an API key is none.
        (["the-admin-key"], ADMIN, (403, "admin_key_required")),
    ],
)
async def test_with_keys_the_data_need_one_and_the_page_does_not(
    short_dir: Path, control: Control, admin_keys: list[str], key: dict[str, str], refused: tuple[int, str]
) -> None:
    config = fake_decoder_config(short_dir, server={"api_keys": ["the-key"], "admin_keys": admin_keys})
    wrong = [{}, {"authorization": "Bearer wrong"}, *([KEY] if key is not KEY else [])]
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, client_for(running) as client:
            for path in ("events", "status"):
                for headers in wrong:
                    error = assert_envelope(await client.get(PAGE + path, headers=headers), refused[0])
                    assert error["code"] == refused[1]
            assert (await client.get(PAGE + "status", headers=key)).status_code == 200
            async with feed(running, key) as events:
                assert (await anext(events))["event"] == "hello"
            for path in ("", "page.js", "page.css"):
                assert (await client.get(PAGE + path)).status_code == 200
            # A HEAD of the feed is answered with its head, and needs the key as its GET does.
            assert (await client.head(PAGE + "events")).status_code == refused[0]
            head = await client.head(PAGE + "events", headers=key)
            assert (head.status_code, head.headers["content-type"]) == (200, "text/event-stream")
            # Only an API key opens the API.
            assert (await client.get("/v1/models", headers=key)).status_code == (401 if admin_keys else 200)


async def test_no_cors_header_on_onebit_paths_even_for_an_origin_the_api_allows(
    short_dir: Path, control: Control
) -> None:
    origin = {"origin": "http://localhost:5173"}  # allowed by the default server.cors_origins
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            api = await client.get("/v1/models", headers=origin)
            preflight = await client.options(
                PAGE + "status", headers={**origin, "access-control-request-method": "GET"}
            )
            answers = [await client.get(PAGE + path, headers=origin) for path in ("", "status", "x")]
            async with client.stream("GET", PAGE + "events", headers=origin) as stream:
                answers.append(stream)
    assert api.headers["access-control-allow-origin"] == origin["origin"]  # the test means something
    for reply in [preflight, *answers]:
        assert not [name for name in reply.headers if name.lower().startswith("access-control-")], reply.url
    assert preflight.status_code == 405


async def test_the_page_follows_the_hosts_rule_of_a_loopback_bind(short_dir: Path, control: Control) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            for path in ("", "status", "events"):
                reply = await client.get(PAGE + path, headers={"host": "evil.example"})
                assert assert_envelope(reply, 403)["code"] == "forbidden_host"


@pytest.mark.parametrize(
    ("bound", "refused", "says"),
    [
        ("MAX_FEEDS", (503, "too_many_feeds"), "the most for all clients"),
        ("MAX_CLIENT_FEEDS", (429, "too_many_client_feeds"), "the most one client may"),
    ],
)
async def test_the_feeds_open_at_once_are_bounded_in_all_and_per_client_and_the_refusal_says_which(
    short_dir: Path, control: Control, monkeypatch: pytest.MonkeyPatch, bound: str, refused: tuple[int, str], says: str
) -> None:
    monkeypatch.setattr(statuspage, bound, 1)
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            async with feed(running) as events:
                await anext(events)
                error = assert_envelope(await client.get(PAGE + "events"), refused[0])
            assert error["code"] == refused[1]
            assert says in error["message"]
            await _wait_feeds(running, 0)
            async with feed(running) as events:
                assert (await anext(events))["event"] == "hello"


async def test_with_admin_keys_each_key_is_a_client_and_all_of_them_share_the_bound_in_all(
    short_dir: Path, control: Control, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(statuspage, "MAX_CLIENT_FEEDS", 1)
    monkeypatch.setattr(statuspage, "MAX_FEEDS", 2)
    keys = ["k1", "k2", "k3"]
    config = fake_decoder_config(short_dir, server={"admin_keys": keys})
    bearer = [{"authorization": f"Bearer {key}"} for key in keys]
    with trio.fail_after(TIMEOUT):
        async with (
            run_daemon(config) as running,
            client_for(running) as client,
            feed(running, bearer[0]) as first,
        ):
            await anext(first)
            same_key = assert_envelope(await client.get(PAGE + "events", headers=bearer[0]), 429)
            async with feed(running, bearer[1]) as second:
                await anext(second)
                third_key = assert_envelope(await client.get(PAGE + "events", headers=bearer[2]), 503)
    assert same_key["code"] == "too_many_client_feeds"
    assert third_key["code"] == "too_many_feeds"
    assert "all clients" in third_key["message"]


async def _wait_feeds(running: Running, n: int) -> None:
    page = running.daemon.front.page
    assert page is not None
    while page.feeds != n:  # noqa: ASYNC110 (the server's hang-up watch ends the feed)
        await trio.sleep(0.01)
