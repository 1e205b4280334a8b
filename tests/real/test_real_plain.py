"""The plain route against the real llama-server and SmolLM2: same text, freed slots, crash recovery.

Every test runs onebitd in-process and also talks to its llama-server straight over the unix socket,
so "what onebitd answers" is always compared with "what the decoder itself answers", never with
text written down here.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import openai
import pytest
import trio
from openai.types.chat import ChatCompletionMessageParam

from supervisor.observe.logs import ROUTE_LOGGER
from supervisor.supervise.child import ChildState
from supervisor.testing import unix_transport
from tests.rigs.rig import Running, make_config, real_llama_server, run_daemon

pytestmark = pytest.mark.real

# Small enough for a 2-core machine shared with other suites: two slots of 1024 tokens each.
MODEL = {"parallel": 2, "ctx_size": 2048}
# Loading SmolLM2 takes about a second; a loaded 2-core machine can make a test take a minute.
DEADLINE_S = 180
# Greedy and a fixed seed: the decoder's answer is a function of the request.
SEED, MAX_TOKENS = 42, 24
GREEDY = {"temperature": 0, "seed": SEED, "max_tokens": MAX_TOKENS}
CHAT_QUESTION = "Name three colours and say one thing about each."
TEXT_PROMPT = "The three primary colours are"
# About 520 tokens of SmolLM2's vocabulary: a prefill that takes a while on a CPU, and still fits in
# one 1024-token slot with room for the reply.
LONG_PROMPT = " ".join(f"word{i}" for i in range(150))
# llama-server (the version scripts/setup pins) logs one line when it lets go of a slot:
#   slot      release: id  0 | task 12 | stop processing: n_tokens = 14, truncated = 0
RELEASE = re.compile(r"release: id +(\d+) \| task +(\d+) \| stop processing: n_tokens = (\d+)")
# openai's AsyncStream stops at [DONE] without closing the async generators it reads the SSE with
# (its own, and httpx2's and httpcore2's beneath); trio, unlike asyncio's loop, warns when such a
# generator is collected.  The client's doing, not onebitd's: ignored only where a test iterates an
# openai stream, and only for generators of those three packages.
OPENAI_STREAM_LEAK = pytest.mark.filterwarnings(
    r"ignore:Async generator '(openai|httpx2|httpcore2)\.[A-Za-z_.]+' was garbage collected:ResourceWarning"
)


@attrs.frozen
class Rig:
    """onebitd, an HTTP client for it, and a client straight to its decoder's socket."""

    running: Running
    front: httpx.AsyncClient
    direct: httpx.AsyncClient

    @property
    def url(self) -> str:
        return self.running.url


@asynccontextmanager
async def open_rig(short_dir: Path) -> AsyncIterator[Rig]:
    real_llama_server()
    config = make_config(short_dir, model=MODEL, hybrid={"enabled": False})
    async with run_daemon(config) as running:
        transport = unix_transport(running.daemon.models.default.parts.launcher.socket)
        timeout = httpx.Timeout(DEADLINE_S)
        async with (
            httpx.AsyncClient(base_url=running.url, timeout=timeout) as front,
            httpx.AsyncClient(transport=transport, base_url="http://decoder", timeout=timeout) as direct,
        ):
            yield Rig(running, front, direct)


@pytest.fixture
def captured(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Route lines, and the decoder's own log lines (onebit relays them under ``onebit.child``)."""
    caplog.set_level(logging.INFO, logger=ROUTE_LOGGER)
    # llama-server's per-request slot lines are relayed at debug (supervisor/supervise/llama_log.py).
    caplog.set_level(logging.DEBUG, logger="onebit.child")
    return caplog


def route_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [getattr(r, "route_fields", {}) for r in caplog.records if r.name == ROUTE_LOGGER]


def released_tokens(caplog: pytest.LogCaptureFixture, task: int) -> int | None:
    """How many cells the decoder's slot held when it let go of ``task`` (prompt + generated)."""
    for record in caplog.records:
        found = RELEASE.search(record.getMessage()) if record.name == "onebit.child" else None
        if found is not None and int(found.group(2)) == task:
            return int(found.group(3))
    return None


async def wait_released(caplog: pytest.LogCaptureFixture, task: int) -> int:
    """:func:`released_tokens`, once the decoder's line has come: it reaches onebitd's log through
    the decoder's output pipe, which onebitd reads every 0.1 s (supervisor/supervise/child.py), so it can
    come after the decoder reports the slot idle.  The caller's ``fail_after`` bounds the wait."""
    found: list[int] = []

    async def logged() -> bool:
        released = released_tokens(caplog, task)
        if released is not None:
            found.append(released)
        return released is not None

    await until(logged)
    return found[0]


async def until(condition: Callable[[], Awaitable[bool]], interval: float = 0.02) -> None:
    """Poll ``condition``; the caller's ``fail_after`` bounds the wait.

    Polling, not an event: what we wait for is the state of another process (llama-server's slots)."""
    while True:
        if await condition():
            return
        await trio.sleep(interval)


async def decoder_slots(rig: Rig) -> list[dict[str, Any]]:
    reply = await rig.direct.get("/slots")
    assert reply.status_code == 200, reply.text
    slots: list[dict[str, Any]] = reply.json()
    return slots


async def wait_decoder_idle(rig: Rig) -> None:
    async def idle() -> bool:
        return not any(slot["is_processing"] for slot in await decoder_slots(rig))

    await until(idle)


async def wait_decoder_busy(rig: Rig) -> dict[str, Any]:
    """The first slot the decoder reports as processing."""
    busy: list[dict[str, Any]] = []

    async def processing() -> bool:
        busy[:] = [slot for slot in await decoder_slots(rig) if slot["is_processing"]]
        return bool(busy)

    await until(processing)
    return busy[0]


async def sse_payloads(reply: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an event stream, in order, without ``[DONE]``."""
    async for raw in reply.aiter_lines():
        if raw.startswith("data:"):
            data = raw[5:].strip()
            if data != "[DONE]":
                yield json.loads(data)


def piece(endpoint: str, payload: dict[str, Any], *, streamed: bool) -> str:
    """The generated text in one answer (whole) or one event (streamed) of ``endpoint``."""
    if endpoint == "/completion":
        return str(payload.get("content") or "")
    choices = payload.get("choices") or []
    if not choices:
        return ""  # llama-server's last chat chunk may carry only usage and timings
    if endpoint == "/v1/completions":
        return str(choices[0].get("text") or "")
    part = choices[0]["delta"] if streamed else choices[0]["message"]
    return str(part.get("content") or "")


async def ask_whole(client: httpx.AsyncClient, endpoint: str, body: dict[str, Any]) -> str:
    reply = await client.post(endpoint, json=body)
    assert reply.status_code == 200, reply.text
    return piece(endpoint, reply.json(), streamed=False)


async def ask_streamed(client: httpx.AsyncClient, endpoint: str, body: dict[str, Any]) -> str:
    async with client.stream("POST", endpoint, json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        return "".join([piece(endpoint, p, streamed=True) async for p in sse_payloads(reply)])


def open_openai(rig: Rig) -> openai.AsyncOpenAI:
    # No retries: a failed request must fail the test, not be quietly asked again.
    return openai.AsyncOpenAI(base_url=f"{rig.url}/v1", api_key="x", max_retries=0, timeout=DEADLINE_S)


# -- the same text as the decoder's own ------------------------------------------------------------


@OPENAI_STREAM_LEAK
async def test_openai_chat_through_onebitd_gets_the_decoders_own_greedy_text(short_dir: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_rig(short_dir) as rig, open_openai(rig) as client:
            model = (await client.models.list()).data[0].id
            body = {"model": model, "messages": [{"role": "user", "content": CHAT_QUESTION}], **GREEDY}
            direct_whole = await ask_whole(rig.direct, "/v1/chat/completions", body)
            direct_streamed = await ask_streamed(rig.direct, "/v1/chat/completions", body)

            messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": CHAT_QUESTION}]
            whole = await client.chat.completions.create(
                model=model, messages=messages, temperature=0, seed=SEED, max_tokens=MAX_TOKENS
            )
            stream = await client.chat.completions.create(
                model=model, messages=messages, temperature=0, seed=SEED, max_tokens=MAX_TOKENS, stream=True
            )
            async with stream:
                deltas = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]

    assert direct_whole, "the decoder said nothing: the comparison would prove nothing"
    assert direct_streamed == direct_whole
    assert whole.choices[0].message.content == direct_whole
    assert "".join(deltas) == direct_whole


@OPENAI_STREAM_LEAK
async def test_openai_completions_through_onebitd_get_the_decoders_own_greedy_text(short_dir: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_rig(short_dir) as rig, open_openai(rig) as client:
            model = (await client.models.list()).data[0].id
            body = {"model": model, "prompt": TEXT_PROMPT, **GREEDY}
            direct_whole = await ask_whole(rig.direct, "/v1/completions", body)
            direct_streamed = await ask_streamed(rig.direct, "/v1/completions", body)

            whole = await client.completions.create(
                model=model, prompt=TEXT_PROMPT, temperature=0, seed=SEED, max_tokens=MAX_TOKENS
            )
            stream = await client.completions.create(
                model=model, prompt=TEXT_PROMPT, temperature=0, seed=SEED, max_tokens=MAX_TOKENS, stream=True
            )
            async with stream:
                pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]

    assert direct_whole, "the decoder said nothing: the comparison would prove nothing"
    assert direct_streamed == direct_whole
    assert whole.choices[0].text == direct_whole
    assert "".join(pieces) == direct_whole


async def test_llama_cpp_completion_endpoint_through_onebitd_gets_the_decoders_own_text(
    short_dir: Path,
) -> None:
    body = {"prompt": TEXT_PROMPT, "n_predict": MAX_TOKENS, "temperature": 0, "seed": SEED}
    with trio.fail_after(DEADLINE_S):
        async with open_rig(short_dir) as rig:
            direct_whole = await ask_whole(rig.direct, "/completion", body)
            direct_streamed = await ask_streamed(rig.direct, "/completion", body)
            whole = await ask_whole(rig.front, "/completion", body)
            streamed = await ask_streamed(rig.front, "/completion", body)

    assert direct_whole, "the decoder said nothing: the comparison would prove nothing"
    assert direct_streamed == direct_whole
    assert whole == direct_whole
    assert streamed == direct_whole


# -- the route line --------------------------------------------------------------------------------


async def test_a_plain_request_logs_a_route_line_with_the_decoders_own_counts(
    short_dir: Path, captured: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_rig(short_dir) as rig, open_openai(rig) as client:
            reply = await client.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": "Say hi"}],
                temperature=0,
                seed=SEED,
                max_tokens=MAX_TOKENS,
            )
            # The line is written once the request has left the in-flight table.
            await rig.running.daemon.front.registry.wait_idle()

    (line,) = route_lines(captured)
    assert reply.usage is not None
    assert line["route"] == "plain"
    assert line["endpoint"] == "/v1/chat/completions"
    assert line["status"] == 200
    assert line["outcome"] == "ok"
    assert line["prompt_tokens"] == reply.usage.prompt_tokens
    assert line["decoder_prompt_n"] > 0
    assert line["slot"] in (0, 1)


# -- a client that goes away frees its slot --------------------------------------------------------


async def test_a_client_that_hangs_up_mid_stream_frees_the_decoders_slot(
    short_dir: Path, captured: pytest.LogCaptureFixture
) -> None:
    # ignore_eos: the reply cannot end by itself before the client hangs up.
    max_tokens = 400
    body = {"prompt": TEXT_PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    with trio.fail_after(DEADLINE_S):
        async with open_rig(short_dir) as rig:
            # Hang up by cancelling the read: a ``break`` would leave httpx's nested async generators
            # open, which trio reports; a cancellation runs through and finishes each of them.
            with trio.CancelScope() as hang_up:
                async with rig.front.stream("POST", "/v1/completions", json=body) as reply:
                    assert reply.status_code == 200
                    seen = 0
                    async for _ in sse_payloads(reply):
                        seen += 1
                        if seen == 3:
                            slot = await wait_decoder_busy(rig)
                            hang_up.cancel()
            assert hang_up.cancelled_caught, "the reply ended before the client could hang up"
            await wait_decoder_idle(rig)
            await rig.running.daemon.front.registry.wait_idle()
            statistics = rig.running.daemon.models.default.parts.slots.statistics()
            released = await wait_released(captured, slot["id_task"])

    assert statistics.busy == 0
    (line,) = route_lines(captured)
    assert line["outcome"] == "cancelled"
    # Idle alone would also follow from the decoder finishing all 400 tokens by itself; a task run
    # to its end releases about prompt + max_tokens cells, a cancelled one a handful past the prompt.
    assert released < slot["n_prompt_tokens"] + max_tokens // 2, "the decoder ran on"


async def test_a_client_that_hangs_up_during_prefill_frees_the_decoders_slot(
    short_dir: Path, captured: pytest.LogCaptureFixture
) -> None:
    max_tokens = 64
    body = {"prompt": LONG_PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    with trio.fail_after(DEADLINE_S):
        async with open_rig(short_dir) as rig:
            async with trio.open_nursery() as nursery:

                async def ask() -> None:
                    async with rig.front.stream("POST", "/v1/completions", json=body) as reply:
                        async for _ in reply.aiter_raw():
                            pass

                nursery.start_soon(ask)
                # The decoder has the request (and is prefilling it): hang up now.
                slot = await wait_decoder_busy(rig)
                nursery.cancel_scope.cancel()
            await wait_decoder_idle(rig)
            await rig.running.daemon.front.registry.wait_idle()
            statistics = rig.running.daemon.models.default.parts.slots.statistics()
            released = await wait_released(captured, slot["id_task"])

    assert slot["n_prompt_tokens"] > 400, "the prompt is too short to stay in prefill for a while"
    assert statistics.busy == 0
    (line,) = route_lines(captured)
    assert line["outcome"] == "cancelled"
    assert line["first_byte_ms"] is None, "a token reached the client: it hung up after prefill"
    assert released < slot["n_prompt_tokens"] + max_tokens // 2, "the decoder ran on"


# -- a decoder that dies mid-stream ----------------------------------------------------------------


async def test_a_decoder_killed_mid_stream_ends_the_stream_with_an_error_event_and_comes_back(
    short_dir: Path, captured: pytest.LogCaptureFixture
) -> None:
    body = {"prompt": TEXT_PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with trio.fail_after(DEADLINE_S):
        async with open_rig(short_dir) as rig:
            decoder = rig.running.daemon.models.default.decoder
            generation, pid = decoder.generation, decoder.pid
            assert pid is not None
            events: list[dict[str, Any]] = []
            async with rig.front.stream("POST", "/v1/completions", json=body) as reply:
                assert reply.status_code == 200
                async for payload in sse_payloads(reply):
                    events.append(payload)
                    if len(events) == 2:
                        os.kill(pid, signal.SIGKILL)  # onebitd started it; it will reap it

            async def back() -> bool:
                return decoder.generation > generation and decoder.state is ChildState.READY

            await until(back)
            new_pid = decoder.pid
            after = await rig.front.post("/v1/completions", json={"prompt": TEXT_PROMPT, **GREEDY})
            await rig.running.daemon.front.registry.wait_idle()

    assert "error" not in events[0]
    assert events[-1]["error"]["code"] == "decoder_lost"
    assert new_pid not in (None, pid)
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["text"]
    first, second = route_lines(captured)
    assert first["outcome"] == "error"
    assert second["outcome"] == "ok"
