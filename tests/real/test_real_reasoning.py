"""A hybrid model's conversation under a template that drops past reasoning, against the real parts:
the tiny Qwen3.5 model (scripts/tiny-models) given llama.cpp's Qwen3.5 template (``--chat-template-file``,
the copy the ggml build keeps beside its bin/).

The template opens the assistant turn with ``<think>`` and renders a past assistant turn without its
reasoning, so after a reply the decoder's slot holds tokens the next turn no longer starts with, and a
recurrent state cannot be cut back to where they part.  What the next turn can use is the state kept at
the previous turn's boundary (supervisor/routes/boundary.py): every turn after the first restores it from
the prefix store and the decoder evaluates the assistant turn as re-rendered, the new user turn and the
generation prompt, nothing more.
"""

from __future__ import annotations

import itertools
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


async def test_a_hybrid_chat_whose_template_drops_past_reasoning_restores_each_turn_at_its_boundary(
    short_dir: Path,
    tiny_models: Path,  # noqa: F811
    route_lines: RouteLines,
) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    replies = []
    with trio.fail_after(DEADLINE_S):
        async with (
            run_daemon(config(short_dir, model_file(tiny_models, "qwen35-dense"))) as running,
            httpx.AsyncClient(base_url=running.url, timeout=120) as client,
        ):
            model = running.daemon.models.default
            for question in QUESTIONS:
                stores = model.store_statistics().stores
                messages.append({"role": "user", "content": question})
                reply = await turn(client, messages)
                replies.append(reply)
                # Sent back as a client does: the reply's content, its reasoning beside it.
                messages.append(
                    {
                        "role": "assistant",
                        "content": reply.get("content") or "",
                        "reasoning_content": reply.get("reasoning_content") or "",
                    }
                )
                await wait_until(partial(stored_more, model, stores))
    # The generation prompt opened the reasoning: the decoder's replies are all reasoning.
    assert all(reply.get("reasoning_content") for reply in replies), replies
    lines = route_lines.lines
    assert [(line["route"], line["outcome"]) for line in lines] == [("plain", "ok")] * 3, lines
    assert lines[0]["restored_tokens"] is None, lines[0]
    for before, line in itertools.pairwise(lines):
        # Restored: the previous turn up to its generation prompt, where this one still matches it.
        assert line["fallback"] == "stored", line
        generation_prompt = before["prompt_tokens"] - line["restored_tokens"]
        assert 0 < generation_prompt <= GENERATION_PROMPT_MAX, (before, line)
        # Evaluated: the assistant turn as re-rendered, the new user turn and the generation prompt.
        assert line["decoder_prompt_n"] <= line["prompt_tokens"] - line["restored_tokens"] + 2, line
