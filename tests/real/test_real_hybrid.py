"""The file route against the real parts: a llama-server decoder, a llama-server (or exec) provider,
SmolLM2.  The reply through the file route must equal what the decoder answers from its own prompt
cache for the same tokens (the fidelity reference: a restore leaves the decoder to evaluate one token,
as a cached prompt does, and llama.cpp's greedy output depends on the batch split), and the decoder
must evaluate about one prompt token instead of the prompt."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from supervisor.config import Config, locate
from supervisor.llama.llama_server import model_args
from supervisor.routes import fidelity
from supervisor.routes.contention import DECODER
from supervisor.routes.rates import Rates
from supervisor.routes.slowdown import Slowdown
from supervisor.supervise.child import ChildState
from supervisor.testing import unix_transport
from tests.rigs import reference
from tests.rigs.helpers import wait_until
from tests.rigs.rig import HANDOFF_ALWAYS, TESTS, RouteLines, child_of, make_config, real_llama_server, run_daemon

pytestmark = pytest.mark.real

QUESTION = "Tell me about the moon in one sentence, please, and mention its phases."
PROMPT = "The moon is Earth's only natural satellite. Write one sentence about its phases:"


def hybrid_config(runtime: Path, provider: dict[str, Any] | None = None) -> Config:
    real_llama_server()
    return make_config(
        runtime,
        model={"parallel": 4, "ctx_size": 2048},
        decoder={"threads": 1},
        hybrid={"enabled": True, "min_prompt_tokens": 16, **HANDOFF_ALWAYS},
        provider=[provider or {"kind": "llama-server", "name": "p0", "threads": 1}],
    )


def body_for(endpoint: str, stream: bool, text: str = "") -> dict[str, Any]:
    common = {"max_tokens": 24, "temperature": 0, "seed": 1, "stream": stream}
    if endpoint == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": text or QUESTION}], **common}
    if endpoint == "/v1/completions":
        return {"prompt": text or PROMPT, **common}
    return {"prompt": text or PROMPT, "n_predict": 24, "temperature": 0, "seed": 1, "stream": stream}


def text_of(endpoint: str, data: dict[str, Any]) -> str:
    if endpoint == "/v1/chat/completions":
        choice = data["choices"][0]
        return str(choice.get("message", choice.get("delta", {})).get("content") or "")
    if endpoint == "/v1/completions":
        return str(data["choices"][0].get("text") or "")
    return str(data.get("content") or "")


async def ask(client: httpx.AsyncClient, endpoint: str, body: dict[str, Any]) -> str:
    """The reply's text, streamed or not."""
    if not body.get("stream"):
        reply = await client.post(endpoint, json=body)
        assert reply.status_code == 200, reply.text
        return text_of(endpoint, reply.json())
    pieces: list[str] = []
    async with client.stream("POST", endpoint, json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                import json

                pieces.append(text_of(endpoint, json.loads(line[6:])))
    return "".join(pieces)


async def plain_reply(socket: Path, endpoint: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Straight to the decoder, no slot cache: what the plain route computes (the reference for a
    request a failed handoff served plain)."""
    transport = unix_transport(socket)
    async with httpx.AsyncClient(transport=transport, base_url="http://decoder", timeout=120) as direct:
        reply = await direct.post(endpoint, json={**body, "stream": False, "cache_prompt": False})
        assert reply.status_code == 200, reply.text
        data = reply.json()
        return text_of(endpoint, data), data["timings"]


async def reference_reply(socket: Path, endpoint: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The reference for a handed-over reply (tests/rigs/reference.py): its text, and the timings of the
    plain prefill of the whole prompt that filled the slot."""
    async with reference.direct(socket) as decoder:
        filled, cached = await reference.cached_reply(decoder, endpoint, body)
    return text_of(endpoint, cached), filled["timings"]


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions", "/completion"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_the_file_route_gives_the_decoders_cached_greedy_reply_with_one_prompt_token_evaluated(
    short_dir: Path, route_lines: RouteLines, endpoint: str, stream: bool
) -> None:
    with trio.fail_after(180):
        async with run_daemon(hybrid_config(short_dir)) as running:
            provider = running.daemon.models.default.parts.providers.all[0]
            await child_of(provider).wait_state(ChildState.READY)
            body = body_for(endpoint, stream)
            expected, plain_timings = await reference_reply(
                running.daemon.models.default.parts.launcher.socket, endpoint, body
            )
            async with httpx.AsyncClient(base_url=running.url, timeout=120) as client:
                got = await ask(client, endpoint, body)
    assert got == expected
    (line,) = route_lines.lines
    assert line["route"] == "file"
    assert line["fallback"] is None
    assert line["outcome"] == "ok"
    assert line["decoder_prompt_n"] <= 2
    # A plain prefill evaluates every prompt token; the file route handed them all over.
    assert plain_timings["prompt_n"] == line["prompt_tokens"]
    assert line["prompt_tokens"] >= 16
    assert line["share_ms"] == 0.0
    assert line["restore_ms"] > 0
    assert list((short_dir / "state").iterdir()) == []


async def test_eight_concurrent_hybrid_requests_over_four_slots_are_all_correct(
    short_dir: Path, route_lines: RouteLines
) -> None:
    questions = [f"Question {i}: name one fact about the number {i * 7}, in a short sentence." for i in range(8)]
    endpoint = "/v1/chat/completions"
    with trio.fail_after(300):
        async with run_daemon(hybrid_config(short_dir)) as running:
            provider = running.daemon.models.default.parts.providers.all[0]
            await child_of(provider).wait_state(ChildState.READY)
            expected = [
                (
                    await reference_reply(
                        running.daemon.models.default.parts.launcher.socket, endpoint, body_for(endpoint, False, q)
                    )
                )[0]
                for q in questions
            ]
            got: dict[int, str] = {}
            async with httpx.AsyncClient(base_url=running.url, timeout=240) as client:

                async def one(i: int) -> None:
                    got[i] = await ask(client, endpoint, body_for(endpoint, i % 2 == 1, questions[i]))

                async with trio.open_nursery() as nursery:
                    for i in range(8):
                        nursery.start_soon(one, i)
    assert [got[i] for i in range(8)] == expected
    assert len(route_lines.lines) == 8
    assert {line["route"] for line in route_lines.lines} == {"file"}
    assert all(line["decoder_prompt_n"] <= 2 for line in route_lines.lines)
    assert {line["slot"] for line in route_lines.lines} <= {0, 1, 2, 3}
    assert list((short_dir / "state").iterdir()) == []


async def test_an_exec_provider_that_writes_a_real_state_file_serves_the_file_route(
    short_dir: Path, route_lines: RouteLines
) -> None:
    base = hybrid_config(short_dir)
    model = locate.model_path(base.model.path)
    assert model is not None
    command = [
        sys.executable,
        str(TESTS / "rigs" / "llama_exec_provider.py"),
        str(real_llama_server()),
        *model_args(base.model, model),
        "-t",
        "1",
    ]
    # A grace on cancel: the program then stops its llama-server and removes its directory itself.
    config = hybrid_config(short_dir, {"kind": "exec", "name": "npu", "command": command, "kill_grace_s": 10})
    endpoint = "/v1/chat/completions"
    body = body_for(endpoint, False)
    with trio.fail_after(300):
        async with run_daemon(config, providers_ready=True) as running:
            (provider,) = running.daemon.models.default.parts.providers.all
            expected, _ = await reference_reply(running.daemon.models.default.parts.launcher.socket, endpoint, body)
            async with httpx.AsyncClient(base_url=running.url, timeout=120) as client:
                got = await ask(client, endpoint, body)
            stats = provider.statistics()
    assert got == expected
    # Measured before its first job (a program onebitd cannot see into), and admitted: its state is
    # the decoder's own build's.  The gate's prompts that fit a 512-token slot (not the long ones).
    assert (stats.refused, stats.jobs) == (None, len(fidelity.START_PROMPTS) + 1)
    (line,) = route_lines.lines
    assert line["route"] == "file"
    assert line["decoder_prompt_n"] <= 2
    assert list((short_dir / "state").iterdir()) == []


async def test_a_worker_provider_with_its_own_llama_server_serves_the_file_route(
    short_dir: Path, route_lines: RouteLines
) -> None:
    base = hybrid_config(short_dir)
    model = locate.model_path(base.model.path)
    assert model is not None
    command = [
        sys.executable,
        str(TESTS / "rigs" / "llama_worker_provider.py"),
        str(real_llama_server()),
        str(short_dir / "state"),
        str(short_dir),
        *model_args(base.model, model),
        "-t",
        "1",
    ]
    config = hybrid_config(short_dir, {"kind": "worker", "name": "npu", "command": command})
    endpoint = "/v1/chat/completions"
    with trio.fail_after(300):
        async with run_daemon(config, providers_ready=True) as running:
            worker = running.daemon.models.default.parts.providers.all[0]
            await child_of(worker).wait_state(ChildState.READY)
            expected = [
                (
                    await reference_reply(
                        running.daemon.models.default.parts.launcher.socket, endpoint, body_for(endpoint, False, q)
                    )
                )[0]
                for q in (QUESTION, QUESTION + " Be brief.")
            ]
            async with httpx.AsyncClient(base_url=running.url, timeout=120) as client:
                got = [
                    await ask(client, endpoint, body_for(endpoint, False, q))
                    for q in (QUESTION, QUESTION + " Be brief.")
                ]
            worker_pid = child_of(worker).pid
            stats = worker.statistics()
    assert got == expected
    assert (stats.refused, stats.jobs) == (None, len(fidelity.START_PROMPTS) + 2)  # measured, then the two
    assert [line["route"] for line in route_lines.lines] == ["file", "file"]
    assert all(line["decoder_prompt_n"] <= 2 for line in route_lines.lines)
    assert worker_pid is not None
    assert not os.path.exists(f"/proc/{worker_pid}")  # noqa: ASYNC240  # reaped: its /proc entry is gone
    assert list((short_dir / "state").iterdir()) == []


async def test_with_kv_share_on_a_stock_llama_server_refuses_and_every_request_takes_the_file_route(
    short_dir: Path, route_lines: RouteLines, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ONEBIT_KV_SHARE", "1")
    # The built llama-server is patched; without its switch it answers as a stock one does.  onebitd
    # sets the switch for a sharing decoder, so the decoder here is started through a wrapper that drops it.
    stock = short_dir / "stock-llama-server"
    stock.write_text(f'#!/bin/sh\nexec env -u LLAMA_KV_SHARE {real_llama_server()} "$@"\n')
    stock.chmod(0o755)
    config = make_config(
        short_dir,
        model={"parallel": 4, "ctx_size": 2048},
        decoder={"threads": 1, "binary": str(stock)},
        hybrid={"enabled": True, "min_prompt_tokens": 16, **HANDOFF_ALWAYS},
        provider=[{"kind": "llama-server", "name": "p0", "threads": 1, "binary": str(real_llama_server())}],
    )
    endpoint = "/v1/chat/completions"
    questions = (QUESTION, QUESTION + " Be brief.")
    with caplog.at_level(logging.INFO, logger="onebit.hybrid"), trio.fail_after(180):
        async with run_daemon(config) as running:
            provider = running.daemon.models.default.parts.providers.all[0]
            # Another binary than the decoder's: admitted by its start-time fidelity check first.
            await provider.wait_settled()
            assert provider.ready
            # The verdict it was admitted with is in its statistics (onebitctl status, the status page).
            admitted = provider.statistics().admitted
            assert admitted is not None
            assert admitted.startswith("next-token TV distance over ")
            expected = [
                (
                    await reference_reply(
                        running.daemon.models.default.parts.launcher.socket, endpoint, body_for(endpoint, False, q)
                    )
                )[0]
                for q in questions
            ]
            async with httpx.AsyncClient(base_url=running.url, timeout=120) as client:
                got = [await ask(client, endpoint, body_for(endpoint, i == 1, q)) for i, q in enumerate(questions)]
    assert got == expected
    first, second = route_lines.lines
    assert (first["route"], first["fallback"], first["share_ms"]) == ("file", "share-refused", 0.0)
    assert (second["route"], second["fallback"]) == ("file", "share-refused-earlier")
    assert first["decoder_prompt_n"] <= 2
    assert second["decoder_prompt_n"] <= 2
    refusals = [r.getMessage() for r in caplog.records if "cannot share its KV" in r.getMessage()]
    # Asked once (the stock server says "Invalid action"), remembered for the second request.
    assert len(refusals) == 1
    assert "share answered 400" in refusals[0]
    assert "Invalid action" in refusals[0]
    assert list((short_dir / "state").iterdir()) == []
    assert [n for n in os.listdir(short_dir) if n.startswith("share-")] == []


async def test_on_shared_cores_a_handoff_waits_for_the_decoders_prefill_in_flight(
    short_dir: Path, route_lines: RouteLines
) -> None:
    """Decoder and provider unpinned on one machine share its cores: a handoff priced while the
    decoder evaluates another request's prompt, whose own prefill is the longer, waits for that
    prompt's first bytes before its provider begins, and its route line says how long."""
    config = make_config(
        short_dir,
        model={"parallel": 2, "ctx_size": 8192},
        decoder={"threads": 1},
        hybrid={"enabled": True, "min_prompt_tokens": 8},
        provider=[{"kind": "llama-server", "name": "p0", "threads": 1}],
    )

    def lines(n: int) -> str:
        return " ".join(f"Line {i}: the river carries stone number {i} down to the sea." for i in range(n))

    with trio.fail_after(300):
        async with run_daemon(config, providers_ready=True) as running:
            completions = running.daemon.models.default.completions

            def believe(decoder_ms: float, provider_ms: float) -> None:
                completions.rates = Rates(
                    decoder_ms_per_token=decoder_ms,
                    provider_ms_per_token=provider_ms,
                    handoff_ms_per_mib=1.0,
                    state_bytes_per_token=1,
                )
                # Beside the decoder's prefill a provider's would take twice as long, beside its
                # replies (the first's is 4 tokens) a fifth longer.
                completions.rates.slowdown = Slowdown(1.0)
                completions.rates.decode_slowdown = Slowdown(0.2)

            believe(20.0, 500.0)  # about 300 tokens, kept plain: 6 s believed, a second or two taken
            async with httpx.AsyncClient(base_url=running.url, timeout=240) as client:

                async def first() -> None:
                    body = {"prompt": lines(20), "n_predict": 4, "stream": True}
                    async with client.stream("POST", "/completion", json=body) as reply:
                        async for _ in reply.aiter_bytes():
                            pass

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(first)
                    await wait_until(lambda: completions.contention.tokens(DECODER) > 0)  # its prefill runs
                    believe(50.0, 5.0)  # about 1,500 tokens, handed over: 7.5 s believed
                    second = await client.post("/completion", json={"prompt": lines(100), "n_predict": 4})
    assert second.status_code == 200
    plain, handed = sorted(route_lines.lines, key=lambda line: line["route"] != "plain")
    assert (plain["route"], handed["route"], handed["fallback"]) == ("plain", "file", None), route_lines.lines
    # It waited, and not until its bound (1.5x a believed 6 s): for less than the first prompt took
    # to its first byte.  (That the first bytes end a wait: test_contention's unit tests.)
    assert 0 < handed["wait_ms"] < plain["first_byte_ms"], (plain, handed)
