"""onebitd is a transparent front: the same requests, straight to its real llama-server (over the
decoder's unix socket) and through onebitd, get the same status, the same body shape (fields and
their types) and, for greedy requests, the same content.

Each test starts one onebitd (two slots of 512 tokens) and walks its cases in order: the whole module
is a handful of decoder starts, a minute or two on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from supervisor.observe.logs import ROUTE_LOGGER
from supervisor.testing import unix_transport
from tests.rigs.rig import make_config, real_llama_server, run_daemon

pytestmark = pytest.mark.real

MODEL = {"parallel": 2, "ctx_size": 1024}  # 512 tokens a slot
DEADLINE_S = 240  # a loaded 2-core machine; a test that takes longer is stuck
KEY = "compat-key"
GREEDY = {"temperature": 0, "seed": 42}
MESSAGES = [{"role": "user", "content": "Name two colours."}]
# About 900 tokens: more than a 512-token slot holds.
OVERFLOW = " ".join(f"word{i}" for i in range(300))


@attrs.frozen
class Rig:
    front: httpx.AsyncClient
    direct: httpx.AsyncClient


@asynccontextmanager
async def open_rig(short_dir: Path, **server: Any) -> AsyncIterator[Rig]:
    real_llama_server()
    config = make_config(short_dir, model=MODEL, hybrid={"enabled": False}, server={"api_keys": [KEY], **server})
    async with run_daemon(config) as running:
        transport = unix_transport(running.daemon.models.default.parts.launcher.socket)
        timeout = httpx.Timeout(DEADLINE_S)
        async with (
            httpx.AsyncClient(base_url=running.url, timeout=timeout) as front,
            httpx.AsyncClient(transport=transport, base_url="http://decoder", timeout=timeout) as direct,
        ):
            yield Rig(front, direct)


def shape(value: Any) -> Any:
    """The fields and their types, not the values: what a client's parser depends on."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    if isinstance(value, int | float):
        return "number"  # 0 and 0.5 are one type to JSON
    return type(value).__name__


def text_of(body: Any) -> str | None:
    """A reply's generated text, whichever API wrote it; None for a reply that has none."""
    if not isinstance(body, dict):
        return None
    if isinstance(body.get("content"), str):  # /completion, /infill
        return str(body["content"])
    if isinstance(body.get("content"), list):  # Anthropic
        return "".join(part.get("text", "") for part in body["content"])
    choices = body.get("choices")
    if isinstance(choices, list) and choices:
        choice = choices[0]
        return str(choice["message"]["content"]) if "message" in choice else str(choice.get("text"))
    output = body.get("output")
    if isinstance(output, list):  # the Responses API
        return "".join(
            part.get("text", "") for item in output for part in item.get("content", []) if isinstance(part, dict)
        )
    return None


@attrs.frozen
class Case:
    method: str
    path: str
    body: Any = None
    greedy: bool = False  # the content must match too
    equal: bool = False  # the whole body must match (no clock, no ids in it)

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and self.body.get("stream") is True


@attrs.frozen
class Seen:
    status: int
    content_type: str
    body: Any  # JSON, or for a stream the list of (event name, JSON payload)
    raw: bytes


async def ask(client: httpx.AsyncClient, case: Case, headers: dict[str, str]) -> Seen:
    content = None if case.body is None else json.dumps(case.body).encode()
    request = client.build_request(case.method, case.path, content=content, headers=headers)
    reply = await client.send(request, stream=True)
    try:
        raw = await reply.aread()
    finally:
        await reply.aclose()
    content_type = reply.headers.get("content-type", "")
    if content_type.startswith("text/event-stream"):
        return Seen(reply.status_code, content_type, events(raw), raw)
    try:
        body = json.loads(raw)
    except ValueError:
        body = raw.decode("utf-8", "replace")
    return Seen(reply.status_code, content_type, body, raw)


def events(raw: bytes) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    for block in raw.decode().replace("\r\n", "\n").split("\n\n"):
        name, data = "", None
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                payload = line[5:].strip()
                data = payload if payload == "[DONE]" else json.loads(payload)
        if data is not None:
            found.append((name, data))
    return found


def streamed_text(seen: list[tuple[str, Any]]) -> str:
    parts: list[str] = []
    for _name, data in seen:
        if not isinstance(data, dict):
            continue
        if isinstance(data.get("content"), str):
            parts.append(data["content"])
        for choice in data.get("choices") or []:
            parts.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
        delta = data.get("delta")
        if isinstance(delta, dict) and isinstance(delta.get("text"), str):
            parts.append(delta["text"])
        if data.get("type") == "response.output_text.delta":
            parts.append(str(data.get("delta", "")))
    return "".join(parts)


def assert_same(case: Case, through: Seen, direct: Seen) -> None:
    where = f"{case.method} {case.path} {json.dumps(case.body)[:80]}"
    assert through.status == direct.status, (where, through.raw[:300], direct.raw[:300])
    assert through.content_type.split(";")[0] == direct.content_type.split(";")[0], where
    if case.stream and through.status == 200:
        assert [name for name, _ in through.body] == [name for name, _ in direct.body], where
        assert [shape(data) for _, data in through.body] == [shape(data) for _, data in direct.body], where
        if case.greedy:
            assert streamed_text(through.body) == streamed_text(direct.body), where
        return
    assert shape(through.body) == shape(direct.body), where
    if case.equal or through.status >= 400:
        assert through.body == direct.body, where  # an error as the decoder wrote it
    if case.greedy:
        assert text_of(through.body) == text_of(direct.body), where
        assert text_of(through.body), where


async def compare(rig: Rig, cases: list[Case]) -> None:
    for index, case in enumerate(cases):
        # Half the cases use Anthropic's header: both are keys to onebitd, neither reaches the decoder.
        key = {"authorization": f"Bearer {KEY}"} if index % 2 else {"x-api-key": KEY}
        through = await ask(rig.front, case, key)
        direct = await ask(rig.direct, case, {})
        assert_same(case, through, direct)


def chat(**extra: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, "max_tokens": 6, **GREEDY, **extra}


def prompt(**extra: Any) -> dict[str, Any]:
    return {"prompt": "The colour of the sky is", "n_predict": 6, "max_tokens": 6, **GREEDY, **extra}


def message(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MESSAGES, "max_tokens": 6, **GREEDY, **extra}


@pytest.fixture
def lines(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger=ROUTE_LOGGER)
    return caplog


def endpoints_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [getattr(r, "route_fields", {})["endpoint"] for r in caplog.records if r.name == ROUTE_LOGGER]


async def test_every_completion_spelling_whole_and_streamed_answers_as_llama_server_does(
    short_dir: Path, lines: pytest.LogCaptureFixture
) -> None:
    cases = []
    for path, body in [
        ("/v1/chat/completions", chat),
        ("/chat/completions", chat),
        ("/v1/completions", prompt),
        ("/completions", prompt),
        ("/completion", prompt),
    ]:
        cases += [Case("POST", path, body(), greedy=True), Case("POST", path, body(stream=True), greedy=True)]
    with trio.fail_after(DEADLINE_S):
        async with open_rig(short_dir) as rig:
            await compare(rig, cases)
    # One route line each, with the path as the client spelt it.
    assert endpoints_logged(lines) == [case.path for case in cases]


async def test_the_other_apis_answer_as_llama_server_does(short_dir: Path, lines: pytest.LogCaptureFixture) -> None:
    tokens = {"tokens": [504, 3458, 282, 260, 6272]}
    cases = [
        Case("POST", "/v1/messages", message(), greedy=True),
        Case("POST", "/v1/messages", message(stream=True), greedy=True),
        Case("POST", "/v1/responses", {"input": "Name two colours.", "max_output_tokens": 6, **GREEDY}, greedy=True),
        Case("POST", "/responses", {"input": "Name two colours.", "max_output_tokens": 6, "stream": True, **GREEDY}),
        Case("POST", "/infill", {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n", "n_predict": 4}),
        Case("POST", "/v1/embeddings", {"input": "hello"}),
        Case("POST", "/embeddings", {"content": "hello"}),
        Case("POST", "/rerank", {"query": "sky", "documents": ["blue", "green"]}),
        Case("POST", "/v1/reranking", {"query": "sky", "documents": ["blue", "green"]}),
        Case("POST", "/tokenize", {"content": "The colour of the sky"}, equal=True),
        Case("POST", "/detokenize", tokens, equal=True),
        Case("POST", "/apply-template", {"messages": MESSAGES}, equal=True),
        Case("POST", "/v1/messages/count_tokens", {"model": "m", "messages": MESSAGES}, equal=True),
        Case("POST", "/chat/completions/input_tokens", {"messages": MESSAGES}, equal=True),
        Case("POST", "/v1/chat/completions/input_tokens", {"messages": MESSAGES}, equal=True),
        Case("GET", "/props"),
        Case("GET", "/models"),
        Case("GET", "/v1/models"),
        Case("GET", "/lora-adapters", equal=True),
        Case("GET", "/health", equal=True),
        Case("GET", "/v1/health", equal=True),
    ]
    with trio.fail_after(DEADLINE_S):
        async with open_rig(short_dir) as rig:
            await compare(rig, cases)
            # The decoder's metrics, alone at /metrics/decoder and after onebitd's at /metrics.
            mine = await rig.front.get("/metrics/decoder")
            theirs = await rig.direct.get("/metrics")
            assert (mine.status_code, theirs.status_code) == (200, 200)
            assert metric_names(mine.text) == metric_names(theirs.text) != set()
            both = (await rig.front.get("/metrics")).text
            assert metric_names(theirs.text) < metric_names(both)
            assert "onebit_slots " in both
    slot_endpoints = ["/v1/messages", "/v1/messages", "/v1/responses", "/responses", "/infill"]
    slot_endpoints += ["/v1/embeddings", "/embeddings", "/rerank", "/v1/reranking"]
    assert endpoints_logged(lines) == slot_endpoints


def metric_names(text: str) -> set[str]:
    return {line.split()[0].split("{")[0] for line in text.splitlines() if line and not line.startswith("#")}


async def test_errors_are_the_decoders_own_words(short_dir: Path) -> None:
    cases = [
        # A context overflow: the client learns by how much (n_prompt_tokens, n_ctx).
        Case("POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": OVERFLOW}])),
        Case("POST", "/chat/completions", chat(messages=[{"role": "user", "content": OVERFLOW}], stream=True)),
        Case("POST", "/completion", prompt(prompt=OVERFLOW)),
        Case("POST", "/v1/messages", message(messages=[{"role": "user", "content": OVERFLOW}])),
        # Bodies only the decoder knows to be wrong.
        Case("POST", "/completion", {"n_predict": 2}),
        Case("POST", "/v1/chat/completions", {"messages": "not a list"}),
        Case("POST", "/v1/completions", prompt(max_tokens="six")),
        Case("POST", "/v1/messages", {"model": "m", "max_tokens": 4}),
        Case("POST", "/v1/responses", {"max_output_tokens": 4}),
        Case("POST", "/detokenize", {"tokens": "not a list"}),
    ]
    with trio.fail_after(DEADLINE_S):
        async with open_rig(short_dir) as rig:
            await compare(rig, cases)
            overflow = (await rig.front.post("/completion", json=prompt(prompt=OVERFLOW), headers=bearer())).json()
    error = overflow["error"]
    assert (error["type"], error["n_ctx"]) == ("exceed_context_size_error", 512)
    assert error["n_prompt_tokens"] > 512


def bearer() -> dict[str, str]:
    return {"authorization": f"Bearer {KEY}"}


async def test_what_onebitd_refuses_or_answers_itself_is_in_llama_servers_shape(short_dir: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_rig(short_dir) as rig:
            # The decoder's own "not started for this" answer: the shape onebitd's refusals copy.
            theirs = (await rig.direct.post("/v1/embeddings", json={"input": "x"})).json()
            for method, path in [("GET", "/slots"), ("POST", "/props"), ("POST", "/slots/0?action=erase")]:
                reply = await rig.front.request(method, path, json={"filename": "x"}, headers=bearer())
                assert (reply.status_code, reply.headers["x-onebit-source"]) == (501, "onebitd"), path
                assert shape(reply.json()) == shape(theirs), path
                assert reply.json()["error"]["type"] == "not_supported_error"
            # Still there: the decoder's slot 0 was not erased by a client.
            assert (await rig.direct.get("/slots")).status_code == 200
            # A preflight carries no key and is answered; an allowed page gets its origin back, as
            # llama-server (cors_origins "*" with credentials, its default) gives it.
            preflight = {"origin": "http://localhost:5173", "access-control-request-method": "POST"}
            mine = await rig.front.options("/v1/chat/completions", headers=preflight)
            direct = await rig.direct.options("/v1/chat/completions", headers=preflight)
            assert mine.status_code == direct.status_code == 200
            for name in ("access-control-allow-origin", "access-control-allow-credentials"):
                assert mine.headers[name] == direct.headers[name], name
            unkeyed = await rig.front.post("/v1/chat/completions", json=chat())
            assert unkeyed.status_code == 401


async def test_slots_is_relayed_when_the_config_serves_it(short_dir: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_rig(short_dir, slots_endpoint=True) as rig:
            mine = await rig.front.get("/slots", headers=bearer())
            theirs = await rig.direct.get("/slots")
    assert (mine.status_code, mine.headers["x-onebit-source"]) == (200, "decoder")
    assert shape(mine.json()) == shape(theirs.json())
    assert [slot["id"] for slot in mine.json()] == [0, 1]
