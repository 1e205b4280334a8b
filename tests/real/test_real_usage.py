"""The usage clients are told, against the real parts: a llama-server decoder, a llama-server provider,
SmolLM2, the file route.  The decoder counts a handed-over prompt as read from its cache (all but its
last token); the reply onebitd relays counts as cached only what the provider's own prompt cache
held, in OpenAI's chat, Anthropic's Messages and the Responses API, whole and streamed, and its
``timings`` keep the decoder's figures beside the provider's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from supervisor.routes.usage import PROVIDER_PROMPT_MS, PROVIDER_PROMPT_N
from supervisor.supervise.child import ChildState
from tests.rigs.asgi import Reply
from tests.rigs.rig import HANDOFF_ALWAYS, RouteLines, child_of, make_config, real_llama_server, run_daemon
from tests.unit.routes.test_usage import told

pytestmark = pytest.mark.real


def question(n: int) -> list[dict[str, Any]]:
    """A user message no earlier request began with (the provider's cache holds none of it)."""
    text = f"Question {n}: name one fact about the number {n * 13}, in one short sentence, please."
    return [{"role": "user", "content": text}]


# Each API, whole and streamed; the chat stream asks for its usage.
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": question(1), "max_tokens": 4, "stream": False}),
    (
        "/v1/chat/completions",
        {"messages": question(2), "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
    ),
    ("/v1/messages", {"messages": question(3), "max_tokens": 4, "stream": False}),
    ("/v1/messages", {"messages": question(4), "max_tokens": 4, "stream": True}),
    ("/v1/responses", {"input": question(5), "max_output_tokens": 4, "stream": False}),
    ("/v1/responses", {"input": question(6), "max_output_tokens": 4, "stream": True}),
]


async def test_a_handed_over_prompt_is_told_as_cached_only_where_the_providers_cache_held_it(
    short_dir: Path, route_lines: RouteLines
) -> None:
    real_llama_server()
    config = make_config(
        short_dir,
        model={"parallel": 2, "ctx_size": 2048},
        decoder={"threads": 1},
        hybrid={"enabled": True, "min_prompt_tokens": 16, **HANDOFF_ALWAYS},
        provider=[{"kind": "llama-server", "name": "p0", "threads": 1}],
    )
    replies: list[Reply] = []
    with trio.fail_after(300):
        async with run_daemon(config) as running:
            await child_of(running.daemon.models.default.parts.providers.all[0]).wait_state(ChildState.READY)
            async with httpx.AsyncClient(base_url=running.url, timeout=120) as client:
                for endpoint, body in REQUESTS:
                    got = await client.post(endpoint, json={**body, "temperature": 0})
                    assert got.status_code == 200, got.text
                    replies.append(Reply(200, dict(got.headers), got.content, []))
    assert len(route_lines.lines) == len(REQUESTS)
    for (endpoint, body), reply, line in zip(REQUESTS, replies, route_lines.lines, strict=True):
        where = f"{endpoint} stream={body['stream']}: {line}"
        assert (line["route"], line["fallback"], line["outcome"]) == ("file", None, "ok"), where
        # The decoder's view (the route line's): nearly the whole prompt read from its slot.
        assert line["decoder_prompt_n"] <= 2, where
        assert line["cached_tokens"] >= line["prompt_tokens"] - 2, where
        said = told(reply)
        # The client's: only what the provider did not evaluate (its own prompt cache may hold the
        # chat template's start, which every request here shares with the one before it).
        assert said.cached == max(0, line["cached_tokens"] - line["provider_prompt_n"]), where
        assert said.prompt == line["prompt_tokens"], where
        if said.timings is not None:
            assert said.timings["cache_n"] == line["cached_tokens"], where
            assert said.timings[PROVIDER_PROMPT_N] == line["provider_prompt_n"], where
            assert said.timings[PROVIDER_PROMPT_MS] == pytest.approx(line["prefill_ms"], abs=0.1), where
    # The first prompt the provider ever saw: nothing of it was in any cache.
    assert told(replies[0]).cached == 0
