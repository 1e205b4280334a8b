"""Tools on the hybrid route with llama.cpp's Llama 3.x chat templates, against the real parts.

The JSON-native tool-call parser of llama-server stopped a reply's content at its first "{" and answered
500 ("does not match the expected peg-native format") when no tool call followed, which SmolLM2's greedy
reply to this question does ("The weather in {city_name} ...").  scripts/llama-server-tools.patch makes
such text content; this test fails on a build without it.  The reference is the decoder answering from
its own prompt cache (the same tokens, its last one evaluated alone, as after a handoff).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from supervisor.config import Config
from supervisor.supervise.child import ChildState

from .rig import HANDOFF_ALWAYS, RouteLines, child_of, make_config, real_llama_server, run_daemon
from .test_real_agent import cached_reply  # the decoder's own prompt-cache reply, on slot 1

pytestmark = pytest.mark.real

DEADLINE_S = 300
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run python code and return stdout",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    }
]
QUESTION = "Give me the weather in Paris as JSON."
LLAMA_TEMPLATES = ("meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.3-70B-Instruct")


def template(stem: str) -> Path:
    # scripts/build-llama-server copies the sdist's models/templates beside the binary's bin/.
    path = real_llama_server().parent.parent / "templates" / f"{stem}.jinja"
    if not path.is_file():
        pytest.fail(f"no {path}: run scripts/setup (the ggml build copies llama.cpp's chat templates)")
    return path


def config(runtime: Path, stem: str) -> Config:
    return make_config(
        runtime,
        model={"parallel": 2, "ctx_size": 4096},
        decoder={"threads": 1, "extra_args": ["--jinja", "--chat-template-file", str(template(stem))]},
        hybrid={"enabled": True, "min_prompt_tokens": 16, **HANDOFF_ALWAYS},
        provider=[{"kind": "llama-server", "name": "p0", "threads": 1}],
    )


def body(tool_choice: str | None, *, stream: bool) -> dict[str, Any]:
    data: dict[str, Any] = {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": QUESTION},
        ],
        "tools": TOOLS,
        "n_predict": 128,
        "temperature": 0,
        "stream": stream,
    }
    if tool_choice is not None:
        data["tool_choice"] = tool_choice
    return data


def streamed_content(text: str) -> str:
    assert '"error"' not in text, text[-400:]
    pieces = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                pieces.append(choice["delta"].get("content") or "")
    return "".join(pieces)


@pytest.mark.parametrize("stem", LLAMA_TEMPLATES)
async def test_a_reply_with_a_brace_that_is_no_tool_call_is_content_on_the_file_route(
    stem: str, short_dir: Path, route_lines: RouteLines
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config(short_dir, stem)) as running:
            await child_of(running.daemon.models.default.parts.providers.all[0]).wait_state(ChildState.READY)
            async with httpx.AsyncClient(base_url=running.url, timeout=120) as client:
                for tool_choice in (None, "none"):
                    cached = await cached_reply(running, "/v1/chat/completions", body(tool_choice, stream=False))
                    reference = cached["choices"][0]["message"]
                    assert "{" in (reference.get("content") or ""), reference  # the case the parser refused
                    reply = await client.post("/v1/chat/completions", json=body(tool_choice, stream=False))
                    assert reply.status_code == 200, reply.text
                    message = reply.json()["choices"][0]["message"]
                    assert message.get("content") == reference.get("content")
                    assert not message.get("tool_calls")
                    async with client.stream("POST", "/v1/chat/completions", json=body(tool_choice, stream=True)) as s:
                        assert s.status_code == 200
                        text = (await s.aread()).decode()
                    assert streamed_content(text) == reference.get("content")
    assert route_lines.lines[0]["route"] == "file", route_lines.lines[0]
    assert all(line["outcome"] == "ok" for line in route_lines.lines), route_lines.lines
