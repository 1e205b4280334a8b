"""A hybrid model's conversation under a template that drops past reasoning, against the real parts:
the tiny Qwen3.5 model (scripts/tiny-models) given llama.cpp's Qwen3.5 template (``--chat-template-file``,
the copy the ggml build keeps beside its bin/).

The template opens the assistant turn with ``<think>`` and renders a past assistant turn without its
reasoning, so after a reply the decoder's slot holds tokens the next turn no longer starts with, and a
recurrent state cannot be cut back to where they part.  The boundary onebit keeps (before the
generation prompt: supervisor/routes/boundary.py) is before the assistant turn, where the next turn
still matches.  While the decoder runs, the next turn is served from llama-server's own context
checkpoints; after a restart, from the prefix store's boundary entry: either way the decoder
evaluates the assistant turn as re-rendered, the new user turn and the generation prompt, nothing more.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from supervisor.config import Config
from tests.real.test_real_families import SYSTEM, model_file, stored_more, tiny_models  # noqa: F401 (a fixture)
from tests.real.test_real_tool_templates import template
from tests.rigs.helpers import wait_until
from tests.rigs.rig import RouteLines, make_config, real_llama_server, run_daemon

pytestmark = pytest.mark.real

DEADLINE_S = 240
QUESTIONS = ("How heavy is item 7?", "And item 9?", "And item 12?")
# The template's generation prompt: "<|im_start|>assistant\n<think>\n", a few tokens.
GENERATION_PROMPT_MAX = 8


def config(runtime: Path, model: Path) -> Config:
    real_llama_server()
    return make_config(
        runtime,
        model={"path": str(model), "parallel": 2, "ctx_size": 4096},
        decoder={"threads": 1, "extra_args": ["--jinja", "--chat-template-file", str(template("Qwen3.5-4B"))]},
        cache={"dir": str(runtime / "store"), "min_tokens": 64, "ram_mib": 0},
    )


async def turn(client: httpx.AsyncClient, messages: list[dict[str, Any]]) -> dict[str, Any]:
    reply = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return dict(reply.json()["choices"][0]["message"])


async def test_a_hybrid_chat_whose_template_drops_past_reasoning_restores_its_boundary_after_a_restart(
    short_dir: Path,
    tiny_models: Path,  # noqa: F811
    route_lines: RouteLines,
) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    replies = []
    path = model_file(tiny_models, "qwen35-dense")

    async def ask(url: str, question: str) -> None:
        messages.append({"role": "user", "content": question})
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            reply = await turn(client, messages)
        replies.append(reply)
        # Sent back as a client does: the reply's content, its reasoning beside it.
        content, reasoning = reply.get("content") or "", reply.get("reasoning_content") or ""
        messages.append({"role": "assistant", "content": content, "reasoning_content": reasoning})

    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config(short_dir, path)) as running:
            model = running.daemon.models.default
            for question in QUESTIONS[:2]:
                stores = model.store_statistics().stores
                await ask(running.url, question)
                await wait_until(partial(stored_more, model, stores))
        async with run_daemon(config(short_dir, path)) as running:
            await ask(running.url, QUESTIONS[2])
    # The generation prompt opened the reasoning: the decoder's replies are all reasoning.
    assert all(reply.get("reasoning_content") for reply in replies), replies
    first, second, third = route_lines.lines
    assert [(line["route"], line["outcome"]) for line in route_lines.lines] == [("plain", "ok")] * 3
    assert first["restored_tokens"] is None, first
    # After the restart: the second turn restored up to its generation prompt, where this one still
    # matches it; the decoder evaluated the assistant turn as re-rendered, the new user turn and the
    # generation prompt.
    assert third["fallback"] == "stored", third
    generation_prompt = second["prompt_tokens"] - third["restored_tokens"]
    assert 0 < generation_prompt <= GENERATION_PROMPT_MAX, (second, third)
    assert third["decoder_prompt_n"] <= third["prompt_tokens"] - third["restored_tokens"] + 2, third
    # Live: the second turn evaluated no more than that either, from the first turn's boundary on
    # (llama-server's checkpoint there, or the store's entry).
    boundary = first["prompt_tokens"] - generation_prompt
    assert second["decoder_prompt_n"] <= second["prompt_tokens"] - boundary + 2, second
