"""The usage a client is told (supervisor/routes/usage.py), in every API llama-server answers, whole
and streamed: a handed-over prompt's tokens are not counted as cached, a prefix store's restore and
a slot's earlier prompt are.  The rig is tests/unit/routes/test_completions.py's: ``Front`` and ``Completions``
against tests/fakes/llama/inprocess.py, whose replies are llama-server's shapes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from supervisor.providers.base import Claim
from supervisor.routes.usage import PROVIDER_PROMPT_MS, PROVIDER_PROMPT_N, Prefill
from tests.rigs.asgi import Reply
from tests.rigs.helpers import client_for, wait_until
from tests.rigs.rig import TIMEOUT as PROCESS_TIMEOUT
from tests.rigs.rig import RouteRig, ScriptedProvider, run_daemon
from tests.unit.routes.test_completions import PROMPT, TIMEOUT, make_rig, restart_decoder, serving_with_store

APIS = ("/v1/chat/completions", "/v1/completions", "/completion", "/v1/messages", "/v1/responses")
# The APIs whose usage counts cached tokens (llama.cpp's own /completion has only ``timings``).
COUNTED = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
CHATS = ("/v1/chat/completions", "/v1/messages", "/v1/responses")  # a chat's prompt, templated


def body(path: str, stream: bool) -> dict[str, Any]:
    """A request for ``path`` with PROMPT as its prompt (its user message), three tokens of reply."""
    message = [{"role": "user", "content": PROMPT}]
    if path == "/v1/chat/completions":
        options = {"stream_options": {"include_usage": True}} if stream else {}
        return {"messages": message, "max_tokens": 3, "stream": stream, **options}
    if path == "/v1/messages":
        return {"messages": message, "max_tokens": 3, "stream": stream}
    if path == "/v1/responses":
        return {"input": PROMPT, "max_output_tokens": 3, "stream": stream}
    return {"prompt": PROMPT, "n_predict" if path == "/completion" else "max_tokens": 3, "stream": stream}


@attrs.frozen
class Told:
    """What a reply tells its client of its prompt: the usage's cached count and prompt length
    (None where the API's usage has none), and the ``timings`` (None where it has none)."""

    cached: int | None
    prompt: int | None
    timings: dict[str, Any] | None


def objects(reply: Reply) -> list[Any]:
    """A whole reply's JSON, or each of a stream's events' ``data``."""
    if not reply.body.startswith((b"data:", b"event:")):
        return [reply.json()]
    lines = [line[5:].strip() for line in reply.body.split(b"\n") if line.startswith(b"data:")]
    return [json.loads(line) for line in lines if line != b"[DONE]"]


def told(reply: Reply) -> Told:
    cached = prompt = timings = None
    for data in objects(reply):
        timings = data.get("timings", timings)
        for holder in (data, data.get("message"), data.get("response")):
            usage = holder.get("usage") if isinstance(holder, dict) else None
            if not isinstance(usage, dict):
                continue
            if "cache_read_input_tokens" in usage:  # Anthropic's: input_tokens are the rest
                cached = usage["cache_read_input_tokens"]
                prompt = usage["input_tokens"] + cached
            for name, total in (("prompt_tokens_details", "prompt_tokens"), ("input_tokens_details", "input_tokens")):
                if name in usage:
                    cached, prompt = usage[name]["cached_tokens"], usage[total]
    return Told(cached, prompt, timings)


@pytest.fixture(params=[False, True], ids=["whole", "stream"])
def stream(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.mark.parametrize("path", APIS)
async def test_a_handed_over_prompt_is_not_told_as_cached_and_timings_say_what_the_provider_spent(
    tmp_path: Path, path: str, stream: bool
) -> None:
    rig = make_rig(tmp_path, ScriptedProvider())
    with trio.fail_after(TIMEOUT):
        reply = await rig.post(path, body(path, stream))
    assert reply.status == 200
    [line] = rig.lines
    assert line.route == "file"
    assert line.prompt_tokens is not None
    # The decoder's view, on the route line: all but the last token reused from its slot.
    assert (line.decoder_prompt_n, line.cached_tokens) == (1, line.prompt_tokens - 1)
    said = told(reply)
    if path in COUNTED:
        assert (said.cached, said.prompt) == (0, line.prompt_tokens)
    if said.timings is not None:  # llama-server's own fields as it gave them, and onebitd's beside them
        assert (said.timings["cache_n"], said.timings["prompt_n"]) == (line.cached_tokens, 1)
        assert said.timings[PROVIDER_PROMPT_N] == line.provider_prompt_n == line.prompt_tokens
        assert said.timings[PROVIDER_PROMPT_MS] == line.prefill_ms == 7.25
    else:
        assert path in ("/v1/messages", "/v1/responses")  # llama-server gives these no timings


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_the_part_of_a_handed_over_prompt_the_providers_cache_held_is_told_as_cached(
    tmp_path: Path, path: str, stream: bool
) -> None:
    rig = make_rig(tmp_path, ScriptedProvider(claim=Claim(evaluated=3, prefill_ms=2.0)))
    with trio.fail_after(TIMEOUT):
        reply = await rig.post(path, body(path, stream))
    [line] = rig.lines
    assert (line.route, line.provider_prompt_n) == ("file", 3)
    assert line.cached_tokens is not None
    assert told(reply).cached == line.cached_tokens - 3


@pytest.mark.parametrize("path", APIS)
async def test_a_plain_request_whose_slot_held_its_prefix_is_told_that_prefix_as_cached(
    tmp_path: Path, path: str, stream: bool
) -> None:
    rig = make_rig(tmp_path, ScriptedProvider(ready=False))
    with trio.fail_after(TIMEOUT):
        cold = await rig.post(path, body(path, stream))
        warm = await rig.post(path, body(path, stream))
    first, second = rig.lines
    assert (first.route, second.route, second.slot) == ("plain", "plain", first.slot)
    assert second.prompt_tokens is not None
    assert (first.cached_tokens, second.cached_tokens) == (0, second.prompt_tokens - 1)
    for reply, line in ((cold, first), (warm, second)):
        said = told(reply)
        if path in COUNTED:
            assert (said.cached, said.prompt) == (line.cached_tokens, line.prompt_tokens)
        if said.timings is not None:
            assert said.timings["cache_n"] == line.cached_tokens
            assert PROVIDER_PROMPT_N not in said.timings


@pytest.mark.parametrize("path", APIS)
async def test_a_prefix_store_restore_is_told_as_cached(tmp_path: Path, path: str, stream: bool) -> None:
    rig = make_rig(tmp_path, ScriptedProvider(ready=False))
    with trio.fail_after(TIMEOUT):
        async with serving_with_store(rig, tmp_path) as store:
            await rig.post(path, body(path, stream))
            await wait_until(lambda: store.statistics().stores == 1)
            restart_decoder(rig)
            reply = await rig.post(path, body(path, stream))
    _, line = rig.lines
    assert line.restored_tokens is not None
    # A chat's entry ends before its generation prompt (one token here), a raw prompt's a token short,
    # and its state file holds the whole prompt: the decoder reuses all but the last token, as from
    # its own cache.
    assert line.prompt_tokens is not None
    assert line.restored_tokens == line.prompt_tokens - 1
    assert line.cached_tokens == line.prompt_tokens - 1
    said = told(reply)
    if path in COUNTED:
        assert said.cached == line.cached_tokens
    if said.timings is not None:
        assert PROVIDER_PROMPT_N not in said.timings


async def test_a_prompt_handed_over_on_the_share_route_is_not_told_as_cached(route_rig: RouteRig) -> None:
    # The share route's handoff, with the process fakes: the decoder adopts the provider's rows.
    route_rig.provider, route_rig.mode = "share", "share"
    path = "/v1/chat/completions"
    with trio.fail_after(PROCESS_TIMEOUT):
        async with run_daemon(route_rig.config()) as running, client_for(running, timeout=PROCESS_TIMEOUT) as client:
            got = await client.post(path, json=body(path, stream=True))
            [line] = await route_rig.route_lines.until(1)
    assert got.status_code == 200
    assert (line["route"], line["fallback"], line["decoder_prompt_n"]) == ("share", None, 1)
    said = told(Reply(200, dict(got.headers), got.content, []))
    assert (said.cached, said.prompt) == (0, line["prompt_tokens"])
    assert said.timings is not None
    assert said.timings["cache_n"] == line["cached_tokens"] == line["prompt_tokens"] - 1
    assert said.timings[PROVIDER_PROMPT_N] == line["provider_prompt_n"]


# -- the rewriting itself, on llama-server's bytes ---------------------------------------------------

PREFILL = Prefill(evaluated=779, prefill_ms=3600.5)
TIMINGS = {"cache_n": 778, "prompt_n": 1, "prompt_ms": 111.2}


def test_an_anthropic_reply_gives_the_handed_over_tokens_back_to_input_tokens() -> None:
    reply = {"type": "message", "usage": {"cache_read_input_tokens": 778, "input_tokens": 1, "output_tokens": 5}}
    body = json.dumps(reply).encode()
    rewritten = json.loads(PREFILL.reply(body, json.loads(body)))
    assert rewritten["usage"] == {"cache_read_input_tokens": 0, "input_tokens": 779, "output_tokens": 5}


def test_a_reply_with_no_counts_is_sent_as_it_came() -> None:
    body = b'{"error": {"code": 500}}'
    assert PREFILL.reply(body, json.loads(body)) is body


def event(data: dict[str, Any], name: str | None = None) -> bytes:
    head = f"event: {name}\n".encode() if name else b""
    return head + b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def test_a_stream_passes_its_token_events_as_they_came_and_rewrites_the_one_with_usage() -> None:
    chunk = {"choices": [{"delta": {"content": " word"}}], "object": "chat.completion.chunk"}
    tokens = [event(chunk) for _ in range(3)]
    usage = {"prompt_tokens": 779, "prompt_tokens_details": {"cached_tokens": 778}}
    last = event({"choices": [], "usage": usage, "timings": TIMINGS})
    rewriter = PREFILL.stream()
    assert all(rewriter.feed(chunk) is chunk for chunk in tokens)  # the very bytes: no copy, no parse
    # The last event cut in three, one cut inside its JSON: nothing goes until its line is whole.
    cuts = [last[:20], last[20:-5], last[-5:] + b"data: [DONE]\n\n"]
    sent = b"".join(rewriter.feed(chunk) for chunk in cuts) + rewriter.flush()
    rewritten, done = sent.split(b"\n\n", 1)[0], sent.split(b"\n\n", 1)[1]
    data = json.loads(rewritten.removeprefix(b"data: "))
    assert data["usage"] == {"prompt_tokens": 779, "prompt_tokens_details": {"cached_tokens": 0}}
    assert data["timings"] == {**TIMINGS, PROVIDER_PROMPT_N: 779, PROVIDER_PROMPT_MS: 3600.5}
    assert done == b"data: [DONE]\n\n"


def test_an_anthropic_stream_rewrites_its_message_start_and_keeps_its_event_lines() -> None:
    start = {"type": "message_start", "message": {"usage": {"cache_read_input_tokens": 778, "input_tokens": 1}}}
    delta = {"type": "content_block_delta", "delta": {"type": "text_delta", "text": 'a "usage" word'}}
    rewriter = PREFILL.stream()
    sent = rewriter.feed(event(start, "message_start") + event(delta, "content_block_delta"))
    first, second, _ = sent.split(b"\n\n")
    assert first.startswith(b"event: message_start\ndata: ")
    usage = json.loads(first.split(b"data: ", 1)[1])["message"]["usage"]
    assert usage == {"cache_read_input_tokens": 0, "input_tokens": 779}
    assert second + b"\n\n" == event(delta, "content_block_delta")  # a quoted word in a string is no key


def test_a_responses_stream_rewrites_response_completed() -> None:
    usage = {"input_tokens": 779, "input_tokens_details": {"cached_tokens": 778}}
    completed = {"type": "response.completed", "response": {"usage": usage}, "timings": TIMINGS}
    sent = PREFILL.stream().feed(event(completed, "response.completed"))
    data = json.loads(sent.split(b"data: ", 1)[1])
    assert data["response"]["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    assert data["timings"][PROVIDER_PROMPT_N] == 779


def test_a_provider_whose_cache_held_a_prefix_leaves_that_prefix_cached() -> None:
    assert Prefill(evaluated=279, prefill_ms=1.0).cached(778) == 499
    assert Prefill(evaluated=None, prefill_ms=None).cached(778) == 0


def test_a_last_line_with_no_newline_is_rewritten_when_the_stream_ends() -> None:
    rewriter = PREFILL.stream()
    assert rewriter.feed(b'data: {"timings":{"cache_n":778}}') == b""
    assert json.loads(rewriter.flush()[6:])["timings"][PROVIDER_PROMPT_N] == 779


def test_a_rewritten_reply_keeps_its_text_whatever_characters_it_holds() -> None:
    # The Responses API's whole output rides in response.completed: a lone surrogate escape (which
    # UTF-8 cannot hold) and non-ASCII text come back as they were read.
    usage = {"input_tokens": 779, "input_tokens_details": {"cached_tokens": 778}}
    reply = {"output": [{"text": "caf\u00e9 \ud800 \u2603"}], "usage": usage}
    body = json.dumps(reply).encode()
    sent = PREFILL.reply(body, json.loads(body))
    assert json.loads(sent)["output"] == reply["output"]
    assert "café".encode() in sent
