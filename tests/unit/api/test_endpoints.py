"""llama-server's API through ``Front``, in process: every spelling, every relayed endpoint, the
refusals, CORS and the key headers, against tests/fakes/llama/inprocess.py and driven through ASGI.

tests/real/test_real_compat.py asks the same of the real llama-server, side by side with onebitd.
"""

from __future__ import annotations

import ast
import json
import logging
import re
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from supervisor.api.endpoints import ROUTES, UNSERVED, Endpoint, Kind, lookup
from supervisor.api.front import Front
from supervisor.api.serving import One
from supervisor.config import HybridConfig, ServerConfig
from supervisor.errors import ListenError
from supervisor.http.respond import anthropic_error_body
from supervisor.llama import chatform
from supervisor.llama.decoder import DecoderClient
from supervisor.llama.slots import SlotPool
from supervisor.providers import Providers
from supervisor.routeline import RouteLine
from supervisor.routes.completion import Completions, Hybrid
from supervisor.routes.file import FileHandoff
from supervisor.supervise.child import ChildState
from tests.fakes.llama.core import chatml
from tests.fakes.llama.inprocess import Events, FakeLlama, HttpxWire
from tests.rigs import asgi
from tests.rigs.asgi import ReadyDecoder, Reply
from tests.rigs.rig import ScriptedProvider, own_cores

TIMEOUT = 10
PROMPT = "the quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "user", "content": PROMPT}]
SETTINGS = HybridConfig(enabled=True, min_prompt_tokens=4)


@attrs.define
class Rig:
    fake: FakeLlama
    slots: SlotPool
    front: Front
    lines: list[RouteLine]

    async def call(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None, query: str = ""
    ) -> Reply:
        with trio.fail_after(TIMEOUT):
            return await asgi.call(self.front, method, path, body, headers, query)


def make_rig(
    tmp_path: Path,
    *,
    hybrid: bool = False,
    transport: Callable[[FakeLlama], httpx.AsyncBaseTransport] | None = None,
    **server: Any,
) -> Rig:
    fake = FakeLlama(tmp_path)
    client = fake.client()
    if transport is not None:
        client = DecoderClient(tmp_path / "unused.sock", transport=HttpxWire(transport(fake)))
    handoff = None
    if hybrid:
        file = FileHandoff(client=client, state_dir=tmp_path, model="fake-model", n_ctx=4096)
        handoff = Hybrid(providers=Providers([ScriptedProvider()]), file=file, placement=own_cores("scripted"))
    decoder = ReadyDecoder()
    slots = SlotPool(2, server.pop("queue_limit", 8))
    completions = Completions(decoder=decoder, client=client, slots=slots, settings=SETTINGS, hybrid=handoff)
    lines: list[RouteLine] = []
    front = Front(
        ServerConfig(**server),
        One(completions, client, decoder),
        emit=lines.append,
        metrics=lambda: b"onebit_up 1\n",
    )
    return Rig(fake, slots, front, lines)


def completion_paths(kind: Kind) -> list[str]:
    return [path for path, methods in ROUTES.items() if any(e.kind is kind for e in methods.values())]


# -- spellings --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "asked"),
    [
        ("/v1/chat/completions", "/v1/chat/completions"),
        ("/chat/completions", "/v1/chat/completions"),
        ("/v1/completions", "/v1/completions"),
        ("/completions", "/completion"),
        ("/completion", "/completion"),
    ],
)
async def test_every_completion_spelling_is_routed_pinned_and_logged_like_its_v1_form(
    tmp_path: Path, path: str, asked: str
) -> None:
    rig = make_rig(tmp_path, hybrid=True)
    body: dict[str, Any] = {"messages": MESSAGES} if asked.endswith("chat/completions") else {"prompt": PROMPT}
    reply = await rig.call("POST", path, {**body, "max_tokens": 3, "n_predict": 3})
    assert reply.status == 200
    assert reply.headers["x-onebit-source"] == "decoder"
    [request] = rig.fake.requests
    assert request.path == asked  # llama-server's handler for this spelling
    [line] = rig.lines
    # The same routing as the /v1 form: the hybrid route, pinned to the slot it restored into.
    assert (line.endpoint, line.route, line.slot, line.outcome) == (path, "file", request.slot, "ok")
    assert rig.fake.actions == [("restore", request.slot)]


def test_the_table_has_every_completion_spelling_llama_server_serves() -> None:
    assert sorted(completion_paths(Kind.COMPLETION)) == sorted(
        [
            *("/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions", "/completion"),
            *("/v1/messages", "/v1/responses", "/responses"),  # the agent APIs, read in chat form
        ]
    )


# -- endpoints that run the model on a slot ---------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "asked"),
    [
        ("/v1/messages", {"system": "Be brief.", "messages": MESSAGES, "max_tokens": 3}, "/v1/messages"),
        ("/v1/responses", {"instructions": "Be brief.", "input": PROMPT, "max_output_tokens": 3}, "/v1/responses"),
        ("/responses", {"instructions": "Be brief.", "input": MESSAGES, "max_output_tokens": 3}, "/v1/responses"),
    ],
)
async def test_an_agent_api_request_is_routed_like_chat_pinned_to_the_slot_it_restored_into(
    tmp_path: Path, path: str, body: dict[str, Any], asked: str
) -> None:
    rig = make_rig(tmp_path, hybrid=True)
    reply = await rig.call("POST", path, body)
    assert (reply.status, reply.headers["x-onebit-source"]) == (200, "decoder")
    [request] = rig.fake.requests
    [(_path, _query, forwarded)] = [s for s in rig.fake.seen if s[0] == asked]
    # Sent on its own endpoint, the client's body as it was, pinned: the reply is llama-server's.
    assert forwarded == {**body, "id_slot": request.slot, "cache_prompt": True}
    [line] = rig.lines
    assert (line.endpoint, line.route, line.fallback, line.slot, line.outcome) == (
        path,
        "file",
        None,
        request.slot,
        "ok",
    )
    # The tokens handed over are the chat form's, as the decoder templates it.
    chat = chatform.to_chat(asked, body)
    assert line.prompt_tokens == len(FakeLlama.tokenize(chatml(chat["messages"]))) == len(request.prompt)
    assert (line.decoder_prompt_n, line.cached_tokens) == (request.prompt_n, request.cache_n)
    assert request.prompt_n == 1
    assert rig.fake.actions[0] == ("restore", request.slot)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
async def test_an_agent_conversations_next_turn_goes_back_to_its_slot_and_reuses_it(tmp_path: Path, path: str) -> None:
    rig = make_rig(tmp_path)
    turns: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
    for _ in range(2):
        body = {"messages": turns, "max_tokens": 3} if path == "/v1/messages" else {"input": turns}
        reply = await rig.call("POST", path, body)
        assert reply.status == 200
        turns = [*turns, {"role": "assistant", "content": "fine"}, {"role": "user", "content": "and then?"}]
        if path == "/v1/responses":
            turns[-2] = {"type": "message", **turns[-2]}
    first, second = rig.fake.requests
    assert first.slot == second.slot
    assert second.cache_n >= len(first.prompt) - 1 > 0  # the whole first prompt (its last token again, maybe)
    assert [line.slot for line in rig.lines] == [first.slot, first.slot]
    assert [line.cached_tokens for line in rig.lines] == [0, second.cache_n]
    assert [line.prompt_tokens for line in rig.lines] == [len(first.prompt), len(second.prompt)]


@pytest.mark.parametrize(
    ("path", "body", "why"),
    [
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
            "non-text message content",
        ),
        ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "llama-server converts"),
        ("/v1/messages", {"max_tokens": 3}, "llama-server converts"),
    ],
)
async def test_an_agent_api_request_that_cannot_be_handed_over_goes_plain_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, path: str, body: dict[str, Any], why: str
) -> None:
    caplog.set_level(logging.INFO, logger="onebit.hybrid")
    rig = make_rig(tmp_path, hybrid=True)
    reply = await rig.call("POST", path, body)
    [line] = rig.lines
    assert (line.route, line.fallback) == ("plain", "unsupported-request")
    assert rig.fake.actions == []
    assert any(why in r.getMessage() for r in caplog.records if r.name == "onebit.hybrid")
    if why == "llama-server converts":
        # llama-server's own refusal, relayed.
        assert (reply.status, reply.headers["x-onebit-source"], line.outcome) == (400, "decoder", "error")


async def test_infill_and_responses_are_pinned_to_the_slot_they_hold(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    for path in ("/infill", "/responses"):
        await rig.call("POST", path, {"input_prefix": "def f(", "input": "hi"})
    forwarded = [(path, body["id_slot"]) for path, _query, body in rig.fake.seen]
    assert [path for path, _slot in forwarded] == ["/infill", "/v1/responses"]
    assert [line.slot for line in rig.lines] == [slot for _path, slot in forwarded]


async def test_a_streamed_message_is_relayed_event_by_event(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    reply = await rig.call("POST", "/v1/messages", {"messages": MESSAGES, "max_tokens": 3, "stream": True})
    assert reply.status == 200
    assert reply.headers["content-type"] == "text/event-stream"
    events = [chunk for chunk in reply.chunks if chunk]
    assert len(events) == 3 + 3  # message_start, 3 deltas, message_delta, message_stop: one chunk each
    assert events[0].startswith(b"event: message_start")
    [line] = rig.lines
    assert (line.route, line.outcome, line.fallback) == ("plain", "ok", None)


async def test_an_embedding_the_decoder_refuses_is_relayed_as_it_wrote_it_with_a_route_line(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    for path in ("/v1/embeddings", "/embeddings", "/embedding", "/rerank", "/v1/reranking"):
        reply = await rig.call("POST", path, {"input": "hello"})
        assert (reply.status, reply.headers["x-onebit-source"]) == (501, "decoder")
        error = reply.json()["error"]
        assert (error["code"], error["type"]) == (501, "not_supported_error")
        assert "Start it with `--" in error["message"]
    assert [(line.endpoint, line.status, line.outcome) for line in rig.lines] == [
        ("/v1/embeddings", 501, "error"),
        ("/embeddings", 501, "error"),
        ("/embedding", 501, "error"),
        ("/rerank", 501, "error"),
        ("/v1/reranking", 501, "error"),
    ]


async def test_a_slot_endpoint_queues_for_a_slot_like_a_completion(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, queue_limit=0)
    async with rig.slots.hold(), rig.slots.hold():
        reply = await rig.call("POST", "/infill", {"input_prefix": "def f(", "input_suffix": ""})
    assert reply.status == 503
    assert reply.json()["error"]["code"] == "overloaded"
    assert [s for s in rig.fake.seen if s[0] == "/infill"] == []
    [line] = rig.lines
    assert (line.endpoint, line.status, line.outcome) == ("/infill", 503, "error")


# -- relayed, refused, served -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/props", None),
        ("GET", "/models", None),
        ("GET", "/v1/models", None),
        ("GET", "/lora-adapters", None),
        ("POST", "/v1/messages/count_tokens", {"messages": MESSAGES}),
    ],
)
async def test_a_relayed_endpoint_answers_what_the_decoder_answers_and_takes_no_slot(
    tmp_path: Path, method: str, path: str, body: Any
) -> None:
    rig = make_rig(tmp_path)
    reply = await rig.call(method, path, body)
    direct = await rig.fake.client().request(method, path, body)
    assert (reply.status, reply.headers["x-onebit-source"]) == (200, "decoder")
    assert reply.body == direct.body
    assert rig.lines == []


async def test_slots_is_501_as_with_no_slots_unless_the_config_serves_it(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    reply = await rig.call("GET", "/slots")
    assert (reply.status, reply.headers["x-onebit-source"]) == (501, "onebitd")
    error = reply.json()["error"]
    assert (error["code"], error["type"]) == (501, "not_supported_error")
    assert "server.slots_endpoint" in error["message"]
    assert rig.fake.seen == []

    rig = make_rig(tmp_path, slots_endpoint=True)
    reply = await rig.call("GET", "/slots", query="fail_on_no_slot=1")
    assert (reply.status, reply.headers["x-onebit-source"]) == (200, "decoder")
    assert [slot["id"] for slot in reply.json()] == [0, 1]
    assert rig.fake.seen == [("/slots", "fail_on_no_slot=1", {})]


@pytest.mark.parametrize(
    ("path", "query", "words"),
    [
        # Changing them needs a restart: a reload says so too.
        ("/props", "", "(decoder.extra_args) and restart onebitd"),
        ("/lora-adapters", "", "(decoder.extra_args) and restart onebitd"),
        ("/slots/0", "action=erase", "owns the decoder's slots"),
        ("/slots/1", "action=restore", "owns the decoder's slots"),
    ],
)
async def test_what_would_change_the_decoder_is_refused_and_says_why(
    tmp_path: Path, path: str, query: str, words: str
) -> None:
    rig = make_rig(tmp_path)
    reply = await rig.call("POST", path, {"filename": "x.bin"}, query=query)
    assert (reply.status, reply.headers["x-onebit-source"]) == (501, "onebitd")
    error = reply.json()["error"]
    assert (error["code"], error["type"]) == (501, "not_supported_error")
    assert words in error["message"]
    assert rig.fake.seen == []


async def test_metrics_appends_the_decoders_and_metrics_decoder_relays_them(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, api_keys=("k",))
    reply = await rig.call("GET", "/metrics")
    assert reply.status == 200
    assert reply.body.startswith(b"onebit_up 1\n")
    assert b"\nllamacpp:prompt_tokens_total 42\n" in reply.body
    decoder = await rig.call("GET", "/metrics/decoder")
    assert (decoder.status, decoder.headers["x-onebit-source"]) == (200, "decoder")
    assert decoder.body == reply.body[len(b"onebit_up 1\n") :]


async def test_a_health_spelling_and_a_head_are_answered_by_onebitd(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    for method, path in [("GET", "/health"), ("GET", "/v1/health"), ("HEAD", "/health")]:
        reply = await rig.call(method, path)
        assert (reply.status, reply.headers["x-onebit-source"]) == (200, "onebitd"), (method, path)


# -- errors as the decoder wrote them ---------------------------------------------------------------

OVERFLOW = {
    "error": {
        "code": 400,
        "message": "request (5000 tokens) exceeds the available context size (1024 tokens), try increasing it",
        "type": "exceed_context_size_error",
        "n_prompt_tokens": 5000,
        "n_ctx": 1024,
    }
}


async def _once(data: Any) -> AsyncGenerator[bytes, None]:
    yield json.dumps(data).encode()


def _overflowing(fake: FakeLlama) -> httpx.AsyncBaseTransport:
    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/v1/chat/completions", "/v1/messages"):
            # A stream, as a real connection's body is: the relay reads an error's body as it comes.
            return httpx.Response(
                400, headers={"content-type": "application/json; charset=utf-8"}, stream=Events(_once(OVERFLOW))
            )
        return await fake.handle(request)

    return httpx.MockTransport(handle)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", ["/chat/completions", "/v1/messages"])
async def test_a_context_overflow_is_relayed_byte_for_byte(tmp_path: Path, path: str, stream: bool) -> None:
    rig = make_rig(tmp_path, transport=_overflowing)
    reply = await rig.call("POST", path, {"messages": MESSAGES, "max_tokens": 3, "stream": stream})
    assert (reply.status, reply.headers["x-onebit-source"]) == (400, "decoder")
    assert reply.headers["content-type"] == "application/json; charset=utf-8"
    assert reply.json() == OVERFLOW
    [line] = rig.lines
    assert (line.status, line.outcome) == (400, "error")
    assert line.error is not None
    assert line.error.startswith("decoder answered 400 (exceed_context_size_error): request (5000 tokens) exceeds")


# -- Anthropic's error shape ------------------------------------------------------------------------


def anthropic_error(reply: Reply) -> tuple[int, str]:
    """The status and Anthropic error type of onebitd's own refusal, in Anthropic's shape exactly."""
    assert reply.headers["x-onebit-source"] == "onebitd"
    data = reply.json()
    assert list(data) == ["type", "error"]
    assert data["type"] == "error"
    assert sorted(data["error"]) == ["message", "type"]
    assert data["error"]["message"]
    return reply.status, data["error"]["type"]


@pytest.mark.parametrize(
    ("method", "path", "body", "server", "expected"),
    [
        ("POST", "/v1/messages", {"messages": MESSAGES}, {"api_keys": ("k",)}, (401, "authentication_error")),
        (
            "POST",
            "/v1/messages/count_tokens",
            {"messages": MESSAGES},
            {"api_keys": ("k",)},
            (401, "authentication_error"),
        ),
        ("GET", "/v1/messages", None, {}, (405, "invalid_request_error")),
        ("POST", "/v1/messages/batches", {"requests": []}, {}, (404, "not_found_error")),
        ("POST", "/v1/messages", "not an object", {}, (400, "invalid_request_error")),
        ("POST", "/v1/messages", {"messages": MESSAGES * 50}, {"max_body_bytes": 256}, (413, "request_too_large")),
    ],
)
async def test_onebitds_refusals_on_anthropics_paths_are_in_anthropics_shape(
    tmp_path: Path, method: str, path: str, body: Any, server: dict[str, Any], expected: tuple[int, str]
) -> None:
    rig = make_rig(tmp_path, **server)
    reply = await rig.call(method, path, body)
    assert anthropic_error(reply) == expected
    assert [s for s in rig.fake.seen if s[0].startswith("/v1/messages")] == []


@pytest.mark.parametrize(
    ("status", "type_"),
    [
        (400, "invalid_request_error"),
        (405, "invalid_request_error"),
        (408, "timeout_error"),
        (431, "invalid_request_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
    ],
)
def test_every_status_has_an_anthropic_error_type(status: int, type_: str) -> None:
    assert json.loads(anthropic_error_body(status, "why")) == {
        "type": "error",
        "error": {"type": type_, "message": "why"},
    }


async def test_a_busy_draining_or_unready_onebitd_is_overloaded_in_anthropics_words(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, queue_limit=0)
    body = {"messages": MESSAGES, "max_tokens": 3}
    async with rig.slots.hold(), rig.slots.hold():
        busy = await rig.call("POST", "/v1/messages", body)
    assert anthropic_error(busy) == (503, "overloaded_error")
    assert busy.headers["retry-after"] == "1"
    rig.front.registry.drain()
    assert anthropic_error(await rig.call("POST", "/v1/messages", body)) == (503, "overloaded_error")
    rig.front.registry.resume()
    assert isinstance(rig.front.router.default.decoder, ReadyDecoder)
    rig.front.router.default.decoder.state = ChildState.STARTING
    unready = await rig.call("POST", "/v1/messages", body)
    assert anthropic_error(unready) == (503, "overloaded_error")
    assert "starting" in unready.json()["error"]["message"]
    assert [line.status for line in rig.lines] == [503, 503, 503]


async def test_the_responses_api_keeps_openais_error_shape(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, api_keys=("k",))
    reply = await rig.call("POST", "/v1/responses", {"input": PROMPT})
    assert reply.status == 401
    assert reply.json()["error"]["type"] == "authentication_error"
    assert reply.json()["error"]["code"] == "invalid_api_key"


# -- CORS and keys ----------------------------------------------------------------------------------

PREFLIGHT = {"access-control-request-method": "POST", "access-control-request-headers": "authorization,content-type"}


async def test_a_preflight_is_answered_before_the_key_check_for_an_allowed_origin_only(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, api_keys=("secret",))
    allowed = await rig.call(
        "OPTIONS", "/v1/chat/completions", headers={"origin": "http://localhost:5173", **PREFLIGHT}
    )
    assert allowed.status == 200
    assert allowed.headers["access-control-allow-origin"] == "http://localhost:5173"
    assert allowed.headers["access-control-allow-credentials"] == "true"
    assert allowed.headers["access-control-allow-headers"] == "authorization,content-type"
    assert "POST" in allowed.headers["access-control-allow-methods"]
    foreign = await rig.call("OPTIONS", "/v1/chat/completions", headers={"origin": "https://evil.example", **PREFLIGHT})
    assert foreign.status == 200
    assert not any(name.startswith("access-control-") for name in foreign.headers)
    assert rig.fake.seen == []


async def test_an_allowed_origin_gets_its_cors_headers_and_a_foreign_write_is_refused(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, cors_origins=("https://app.example",))
    body = {"prompt": PROMPT, "n_predict": 2}
    ok = await rig.call("POST", "/completion", body, headers={"origin": "https://app.example"})
    assert (ok.status, ok.headers["access-control-allow-origin"]) == (200, "https://app.example")
    refused = await rig.call("POST", "/completion", body, headers={"origin": "http://localhost:3000"})
    assert refused.status == 403
    assert refused.json()["error"]["code"] == "cross_origin"
    assert "access-control-allow-origin" not in refused.headers
    # A read is no write: it is answered, and the browser keeps the answer from a foreign page.
    models = await rig.call("GET", "/v1/models", headers={"origin": "https://evil.example"})
    assert models.status == 200
    assert "access-control-allow-origin" not in models.headers


async def test_cors_origins_star_lets_any_page_call_as_llama_servers_default_does(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, cors_origins=("*",))
    reply = await rig.call(
        "POST", "/completion", {"prompt": PROMPT, "n_predict": 2}, headers={"origin": "https://x.example"}
    )
    assert (reply.status, reply.headers["access-control-allow-origin"]) == (200, "https://x.example")


# -- listening ---------------------------------------------------------------------------------------


async def test_every_address_of_server_host_is_bound_and_a_loopback_list_keeps_the_host_guard(
    tmp_path: Path,
) -> None:
    rig = make_rig(tmp_path, host=("127.0.0.1", "::1"), port=0)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            binds: list[str] = await nursery.start(rig.front.run)
            assert len(binds) == 2
            for url in binds:
                async with httpx.AsyncClient(base_url=url) as client:
                    assert (await client.get("/health")).status_code == 200
                    foreign = await client.get("/health", headers={"host": "evil.example"})
                    assert foreign.json()["error"]["code"] == "forbidden_host"
            rig.front.stop()


async def test_an_address_that_cannot_be_bound_is_an_error_naming_server_host(tmp_path: Path) -> None:
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): no machine has it, so binding it fails with EADDRNOTAVAIL.
    rig = make_rig(tmp_path, host=("127.0.0.1", "192.0.2.1"), port=0)
    with trio.fail_after(TIMEOUT), pytest.raises(ListenError) as caught:
        await rig.front.run()
    assert str(caught.value) == "server.host: cannot listen on 192.0.2.1 port 0: Cannot assign requested address"


# -- a client that takes nothing ---------------------------------------------------------------------


async def test_a_client_past_the_write_timeout_is_cancelled_like_a_hang_up_and_its_line_says_why(
    tmp_path: Path,
) -> None:
    # The server's side of it (tests/unit/http/test_server.py): a write that waited write_timeout_s gives up and
    # the app hears http.disconnect with the reason.  Here, what the front makes of that.
    rig = make_rig(tmp_path)
    why = "the client took no byte of its response for 60s (server.write_timeout_s)"
    stuck = trio.Event()
    asked = False

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if not asked:
            asked = True
            body = json.dumps({"messages": MESSAGES, "stream": True, "max_tokens": 3}).encode()
            return {"type": "http.request", "body": body, "more_body": False}
        await stuck.wait()
        return {"type": "http.disconnect", "reason": why}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            stuck.set()  # the client's socket is full: this write waits until the deadline gives up
            await trio.sleep_forever()

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "query_string": b"",
        "headers": [(b"host", b"localhost"), (b"content-type", b"application/json")],
    }
    with trio.fail_after(TIMEOUT):
        await rig.front(scope, receive, send)
    [line] = rig.lines
    assert (line.outcome, line.error, line.status) == ("cancelled", why, 200)
    assert rig.slots.statistics().busy == 0
    assert rig.front.registry.requests == {}


# -- the table against llama-server's own ---------------------------------------------------------

ROUTE_LIST = Path(__file__).parents[2] / "data" / "llama-server-routes.txt"
PROTOCOL = Path(__file__).parents[3] / "docs" / "protocol.md"


def llama_server_routes() -> list[tuple[str, str]]:
    """llama-server's routes, as tests/data/llama-server-routes.txt keeps them (how it was made is
    written at its top)."""
    routes = []
    for raw in ROUTE_LIST.read_text().splitlines():
        if raw and not raw.startswith("#"):
            method, path = raw.split()
            routes.append((method, path))
    return routes


def onebitd_answer(method: str, path: str) -> Endpoint | str | None:
    """What onebitd's table does with a route of llama-server's: its endpoint, why it is not
    served, or None (the table forgot it)."""
    if (method, path) in UNSERVED:
        return UNSERVED[(method, path)]
    if path == "/predict":
        return Endpoint(Kind.PREDICT)  # where AIP_MODE asks for it: tests/unit/api/test_vertex.py
    methods = lookup(path.replace(":id_slot", "0")) or {}
    return methods.get(method)


def test_every_route_of_llama_servers_table_is_served_relayed_routed_refused_or_named_unserved() -> None:
    routes = llama_server_routes()
    assert len(routes) > 40  # the file is the list, not a stub
    assert [route for route in routes if onebitd_answer(*route) is None] == []


def test_every_path_onebitd_serves_is_llama_servers_but_its_own_decoder_metrics() -> None:
    theirs = {path for _method, path in llama_server_routes()}
    ours = {(method, path) for path, methods in ROUTES.items() for method in methods}
    assert {(m, p) for m, p in ours if p not in theirs} == {("GET", "/metrics/decoder")}
    assert {(m, p) for m, p in ours if (m, p) not in set(llama_server_routes())} == {("GET", "/metrics/decoder")}
    assert set(UNSERVED) <= set(llama_server_routes())


def test_the_protocol_docs_table_names_every_route_of_llama_servers() -> None:
    text = PROTOCOL.read_text()
    table = text[text.index("## The HTTP API") : text.index("### CORS")]
    missing = [path for _method, path in llama_server_routes() if f"`{path}" not in table]
    assert missing == []


async def test_the_cors_proxy_is_relayed_as_llama_server_answers_it_with_keys_and_cors_applied(
    tmp_path: Path,
) -> None:
    rig = make_rig(tmp_path, api_keys=("k",))
    key = {"authorization": "Bearer k"}
    assert (await rig.call("GET", "/cors-proxy", query="url=http%3A%2F%2Fexample")).status == 401
    reply = await rig.call("GET", "/cors-proxy", headers={**key, "origin": "http://localhost:5173"}, query="url=x")
    assert (reply.status, reply.headers["x-onebit-source"]) == (403, "decoder")
    assert reply.json()["error"]["type"] == "feature_disabled"
    assert reply.headers["access-control-allow-origin"] == "http://localhost:5173"
    assert ("/cors-proxy", "url=x", {}) in rig.fake.seen
    cross = await rig.call("POST", "/cors-proxy", {"jsonrpc": "2.0"}, {**key, "origin": "https://evil.example"})
    assert (cross.status, cross.json()["error"]["code"]) == (403, "cross_origin")
    assert [seen for seen in rig.fake.seen if seen[0] == "/cors-proxy" and seen[2]] == []


async def test_the_cors_proxy_gets_the_clients_proxy_headers_and_no_credential(tmp_path: Path) -> None:
    """llama-server's MCP proxy forwards ``x-llama-server-proxy-header-<name>`` to its target as
    ``<name>``: those reach the decoder as the client sent them, its key, cookies and proxy
    credentials do not (tests/real/test_real_cors_proxy.py: what the target then gets)."""
    rig = make_rig(tmp_path, api_keys=("k",))
    sent = {
        "authorization": "Bearer k",
        "cookie": "session=secret",
        "proxy-authorization": "Basic secret",
        "x-api-key": "k",
        "accept": "text/html",
        "x-llama-server-proxy-header-accept": "application/json",
        "x-llama-server-proxy-header-authorization": "Bearer explicit",
        "x-llama-server-proxy-header-mcp-session-id": "s-1",
        "x-llama-server-proxy-header-": "nameless",
    }
    for method in ("GET", "POST"):
        reply = await rig.call(method, "/cors-proxy", {"jsonrpc": "2.0"} if method == "POST" else None, sent, "url=x")
        assert reply.status == 403
        [(_path, got)] = [seen for seen in rig.fake.headed if seen[0] == "/cors-proxy"]
        rig.fake.headed.clear()
        assert {name: value for name, value in got.items() if name.startswith("x-llama")} == {
            "x-llama-server-proxy-header-accept": "application/json",
            "x-llama-server-proxy-header-authorization": "Bearer explicit",
            "x-llama-server-proxy-header-mcp-session-id": "s-1",
        }
        assert not {"authorization", "cookie", "proxy-authorization", "x-api-key"} & set(got)
        assert got.get("accept") != "text/html"
    # One the decoder's wire cannot carry (it could end the head) is the client's error, not sent.
    bad = await rig.call(
        "GET", "/cors-proxy", headers={**sent, "x-llama-server-proxy-header-x": "a\x7fb"}, query="url=x"
    )
    assert (bad.status, bad.json()["error"]["code"]) == (400, "bad_header")
    assert [seen for seen in rig.fake.headed if seen[0] == "/cors-proxy"] == []
    # Elsewhere the prefix is nobody's: /props gets no proxy header.
    await rig.call("GET", "/props", headers=sent)
    assert [name for _path, got in rig.fake.headed for name in got if name.startswith("x-llama")] == []


# -- the table decides ------------------------------------------------------------------------------

API = Path(__file__).parents[3] / "supervisor" / "api"


@pytest.mark.parametrize(
    "module", sorted(p.name for p in API.glob("*.py") if p.name not in ("endpoints.py", "vertex.py"))
)
def test_no_module_of_the_api_but_the_table_names_a_path(module: str) -> None:
    """What the front does with a path is the table's word (an endpoint's kind and fields), so no
    other module of the api compares or spells one (vertex.py: Vertex AI's own default route)."""
    tree = ast.parse((API / module).read_text())
    paths = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"/[\w/.-]+", node.value)
    ]
    assert paths == []


def test_what_the_front_does_beyond_a_kind_is_an_endpoints_field() -> None:
    def paths(field: str) -> list[str]:
        return sorted(path for path, methods in ROUTES.items() if any(getattr(e, field) for e in methods.values()))

    assert paths("public") == ["/health", "/metrics", "/metrics/decoder", "/v1/health"]
    assert paths("listing") == ["/models", "/v1/models"]
    assert paths("gated") == ["/slots"]
    not_generating = sorted(path for path, methods in ROUTES.items() if any(not e.generates for e in methods.values()))
    assert not_generating == sorted(
        ["/embedding", "/embeddings", "/v1/embeddings", "/rerank", "/reranking", "/v1/rerank", "/v1/reranking"]
    )
