"""Tools on the hybrid route with every chat template llama.cpp ships, against the real parts.

The JSON-native tool-call parser of llama-server stopped a reply's content at its first "{" and answered
500 ("does not match the expected peg-native format") when no tool call followed, which SmolLM2's greedy
reply does with the Llama 3.x templates ("The weather in {city_name} ...") to the first of BRACE_QUESTIONS
on an AVX2 CPU, to a later one where the CPU's kernels change its reply (a Zen 4's).
patches/llama-server-tools.patch makes such text content; the Llama test fails on a build without it.

The matrix then takes each of the sdist's ``models/templates`` (the ggml build copies them beside its
bin/) through the file route, and holds onebitd to what the decoder answers from its own prompt cache
(the same tokens, its last one evaluated alone, as after a handoff): the same status, the same message
(content, reasoning, tool calls) or the same error.  SmolLM2 was not trained on these formats, so with a
few templates the decoder itself refuses its reply (REFUSED, with llama-server alone as with onebitd);
there onebitd must refuse it the same way, and the test fails when upstream starts to accept it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from supervisor.config import Config, locate
from supervisor.supervise.child import ChildState
from tests.rigs.reference import cached_reply, direct_to, fill, pinned
from tests.rigs.rig import HANDOFF_ALWAYS, RouteLines, Running, child_of, make_config, real_llama_server, run_daemon

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
# SmolLM2's greedy reply depends on the CPU's kernels: on a Zen 4 (the zen4 CPU variant) it answers
# QUESTION with no brace at all.  The brace test takes the first of these whose reply, from the
# decoder's own cache, holds a "{" and no tool call.
BRACE_QUESTIONS = (
    QUESTION,
    'Reply with the JSON object {"city": "Paris", "weather": "sunny"} and one sentence about it.',
    "Write a Python dict literal for the weather in Paris, then explain it.",
    "Show the weather in Paris as a JSON object with curly braces.",
)
LLAMA_TEMPLATES = ("meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.3-70B-Instruct")
MATRIX_TOKENS = 48
PEG = "The model produced output that does not match the expected peg-native format"
# Templates whose format SmolLM2's greedy reply to QUESTION does not follow, so that llama-server's own
# parser refuses it (500, PEG) for these tool_choice values, with or without onebitd (measured on the
# pinned build, scripts/llama-server alone, 2026-12-04): gpt-oss's harmony channels, functionary's
# ">>>" recipients, Command R's "Action:"/<|START_RESPONSE|> blocks, llm-jp's thinking markers.
REFUSED: dict[str, tuple[str | None, ...]] = {
    "CohereForAI-c4ai-command-r-plus-tool_use": (None,),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": (None, "none"),
    "llm-jp-llm-jp-4.1-8b-thinking": (None, "none"),
    "meetkai-functionary-medium-v3.2": (None, "none"),
    "openai-gpt-oss-120b": (None, "none"),
}


def templates_folder(binary: Path) -> Path:
    # scripts/build-llama-server copies the sdist's models/templates beside the binary's bin/.
    return binary.parent.parent / "templates"


def shipped_templates() -> list[str]:
    """The templates the ggml build copied, at collection; one failing entry where there are none."""
    found = locate.llama_server("")
    folder = templates_folder(found) if found is not None else None
    stems = sorted(p.stem for p in folder.glob("*.jinja")) if folder is not None and folder.is_dir() else []
    return stems or ["no-templates-run-scripts-setup"]


def template(stem: str) -> Path:
    path = templates_folder(real_llama_server()) / f"{stem}.jinja"
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


def body(tool_choice: str | None, *, stream: bool, question: str = QUESTION) -> dict[str, Any]:
    data: dict[str, Any] = {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": question},
        ],
        "tools": TOOLS,
        "n_predict": 128,
        "temperature": 0,
        "stream": stream,
    }
    if tool_choice is not None:
        data["tool_choice"] = tool_choice
    return data


@pytest.mark.parametrize("stem", LLAMA_TEMPLATES)
async def test_a_reply_with_a_brace_that_is_no_tool_call_is_content_on_the_file_route(
    stem: str, short_dir: Path, route_lines: RouteLines
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config(short_dir, stem)) as running:
            await child_of(running.daemon.models.default.parts.providers.all[0]).wait_state(ChildState.READY)
            async with httpx.AsyncClient(base_url=running.url, timeout=120) as client:
                for tool_choice in (None, "none"):
                    question, reference = await brace_reply(running, tool_choice)
                    ask = body(tool_choice, stream=False, question=question)
                    reply = await client.post("/v1/chat/completions", json=ask)
                    assert reply.status_code == 200, reply.text
                    message = reply.json()["choices"][0]["message"]
                    assert message.get("content") == reference.get("content")
                    assert not message.get("tool_calls")
                    streaming = body(tool_choice, stream=True, question=question)
                    async with client.stream("POST", "/v1/chat/completions", json=streaming) as s:
                        assert s.status_code == 200
                        text = (await s.aread()).decode()
                    got, error = streamed(text)
                    assert error is None, text[-400:]
                    assert got == essence(reference), got
    assert route_lines.lines[0]["route"] == "file", route_lines.lines[0]
    assert all(line["outcome"] == "ok" for line in route_lines.lines), route_lines.lines


async def brace_reply(running: Running, tool_choice: str | None) -> tuple[str, dict[str, Any]]:
    """The first of BRACE_QUESTIONS whose reply from the decoder's own cache holds a brace and no tool
    call (the case the parser refused), and that reply; the test fails where none does."""
    seen = []
    for question in BRACE_QUESTIONS:
        async with direct_to(running) as decoder:
            asked = body(tool_choice, stream=False, question=question)
            _, cached = await cached_reply(decoder, "/v1/chat/completions", asked)
        reference: dict[str, Any] = cached["choices"][0]["message"]
        if "{" in (reference.get("content") or "") and not reference.get("tool_calls"):
            return question, reference
        seen.append(reference)
    pytest.fail(f"no question's reply holds a brace and no tool call on this CPU: {seen}")


def essence(message: dict[str, Any]) -> dict[str, Any]:
    """What a reply says: its content, reasoning and tool calls (their ids are random per reply)."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return {
        "content": message.get("content") or "",
        "reasoning": message.get("reasoning_content") or "",
        "tool_calls": calls,
    }


def streamed(text: str) -> tuple[dict[str, Any], str | None]:
    """A streamed reply put together: its essence, and the message of an error event if one came."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, tuple[str, str]] = {}
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            return {}, event["error"]["message"]
        for choice in event["choices"]:
            delta = choice["delta"]
            content.append(delta.get("content") or "")
            reasoning.append(delta.get("reasoning_content") or "")
            for call in delta.get("tool_calls") or []:
                name, arguments = calls.get(call["index"], ("", ""))
                function = call.get("function") or {}
                calls[call["index"]] = (
                    name + (function.get("name") or ""),
                    arguments + (function.get("arguments") or ""),
                )
    message = {
        "content": "".join(content),
        "reasoning": "".join(reasoning),
        "tool_calls": [calls[i] for i in sorted(calls)],
    }
    return message, None


Answer = tuple[int, dict[str, Any], str | None]  # status, essence, the error's message


async def answer(client: httpx.AsyncClient, data: dict[str, Any]) -> Answer:
    """One request's answer, the way it left: whole, or streamed and put together."""
    if not data["stream"]:
        reply = await client.post("/v1/chat/completions", json=data)
        if reply.status_code != 200:
            return reply.status_code, {}, reply.json()["error"]["message"]
        return reply.status_code, essence(reply.json()["choices"][0]["message"]), None
    async with client.stream("POST", "/v1/chat/completions", json=data) as s:
        text = (await s.aread()).decode()
    if s.status_code != 200:
        return s.status_code, {}, json.loads(text)["error"]["message"]
    message, error = streamed(text)
    return s.status_code, message, error


async def from_the_decoders_cache(running: Running, data: dict[str, Any]) -> Answer:
    """``cached_reply`` that keeps a refusal and the way the reply leaves: the prompt once to fill
    slot 1 (one reply token: the slot keeps the prompt), then the body, which evaluates only the
    prompt's last token.  Streamed against streamed: llama-server's parser splits reasoning from
    content differently in the two (DeepSeek V4's "<think>" is content whole, reasoning streamed)."""
    async with direct_to(running) as decoder:
        # The prompt is what it keeps; a parser may refuse the one-token reply (functionary's PEG format).
        await fill(decoder, "/v1/chat/completions", {**data, "n_predict": 1}, answered=False)
        return await answer(decoder, pinned(data))


@pytest.mark.parametrize("stem", shipped_templates())
async def test_each_shipped_template_answers_on_the_file_route_as_the_decoder_does_from_its_cache(
    stem: str, short_dir: Path, route_lines: RouteLines
) -> None:
    # tool_choice unset asked whole, "none" streamed: both parsers' paths, both ways a reply leaves.
    cases: tuple[tuple[str | None, bool], ...] = ((None, False), ("none", True))
    with trio.fail_after(DEADLINE_S):
        async with (
            run_daemon(config(short_dir, stem), providers_ready=True) as running,
            httpx.AsyncClient(base_url=running.url, timeout=120) as client,
        ):
            for tool_choice, stream in cases:
                data = {**body(tool_choice, stream=stream), "n_predict": MATRIX_TOKENS}
                reference = await from_the_decoders_cache(running, data)
                refused = tool_choice in REFUSED.get(stem, ())
                assert (reference[2] == PEG) == refused, (tool_choice, stream, reference)
                assert reference[0] == (200 if stream or not refused else 500), (tool_choice, reference)
                assert await answer(client, data) == reference, (tool_choice, stream)
    assert [line["route"] for line in route_lines.lines] == ["file"] * len(cases), route_lines.lines
