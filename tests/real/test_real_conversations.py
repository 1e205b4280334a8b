"""A conversation of three turns per model family, through a swap back and a full restart (issue 53's
matrix): every turn after the first restores or reuses the conversation, and the decoder evaluates
only the new turn (its tokens, the template's generation prompt and a token or two), whatever the
family keeps: a dense or sliding-window model's whole prompt, a hybrid model's state at the point the
next turn still matches (a chat's before its generation prompt, a raw prompt less its last token).

Per family (dense, sliding-window under ``swa_full = "auto"``, hybrid recurrent, hybrid convolution,
mamba2 hybrid, MoE) and per endpoint (``/v1/chat/completions``; a raw ``/completion`` whose next
prompt continues the last one with its reply): the first turn, kept plain by the shipped cost
decision, and on its own handed over to a provider (``route_by = "length"``); the second after the
model was swapped out for another and back (``max_loaded = 1``); the third after onebitd stopped and
started again over the same store.  Every route line is read.
"""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from supervisor.config import Config, locate
from supervisor.models.model import Model
from supervisor.routes.capability import Restores
from supervisor.testing import Running
from tests.real.test_real_families import (
    FAMILIES,
    PROMPT,
    SYSTEM,
    assert_cold,
    assert_went_on,
    generation_prompt_n,
    model_file,
    tiny_models,
)
from tests.rigs.helpers import wait_until
from tests.rigs.rig import HANDOFF_ALWAYS, RouteLines, make_config, real_llama_server, run_daemon

pytestmark = pytest.mark.real

__all__ = ["tiny_models"]  # the fixture, imported for this module's tests

DEADLINE_S = 300
GENERATION_PROMPT_MAX = 8  # "<|im_start|>assistant\n" and its like: a handful of tokens
QUESTIONS = ["How heavy is item 7?", "And item 9?", "And item 12?"]
NAMES = ["llama-dense", "gemma3-dense", "qwen35-dense", "lfm2-dense", "granitehybrid-dense", "qwen3moe-moe"]


def two_models(runtime: Path, first: Path, store: Path) -> Config:
    """``first`` (the default, with a provider, the route chosen by cost as shipped) and the
    embedded model beside it, one loaded at a time."""
    real_llama_server()
    other = locate.embedded_model()
    assert other is not None
    return make_config(
        runtime,
        model=[
            {"name": "first", "path": str(first), "parallel": 1, "ctx_size": 4096},
            {"name": "other", "path": str(other), "parallel": 1, "ctx_size": 2048, "preload": False},
        ],
        models={"max_loaded": 1},
        decoder={"threads": 1},
        cache={"dir": str(store), "min_tokens": 64, "ram_mib": 0},
        hybrid={"enabled": True, "min_prompt_tokens": 16},
        provider=[{"kind": "llama-server", "name": "p0", "threads": 1}],
    )


def handing_over(runtime: Path, path: Path) -> Config:
    """The model alone, every prompt of 16 tokens or more handed over to its provider."""
    real_llama_server()
    return make_config(
        runtime,
        model={"path": str(path), "parallel": 1, "ctx_size": 4096},
        decoder={"threads": 1},
        cache={"dir": str(runtime / "store"), "min_tokens": 64, "ram_mib": 0},
        hybrid={"enabled": True, "min_prompt_tokens": 16, **HANDOFF_ALWAYS},
        provider=[{"kind": "llama-server", "name": "p0", "threads": 1}],
    )


class Conversation:
    """One conversation's turns on one endpoint: the chat's messages, or the raw prompt so far."""

    def __init__(self, endpoint: str, model: str | None = "first") -> None:
        self.endpoint = endpoint
        self.model = {"model": model} if model is not None else {}
        self.messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        self.text = PROMPT

    def ask(self, question: str) -> None:
        if self.endpoint == "chat":
            self.messages.append({"role": "user", "content": question})
        else:
            self.text += f"\nQ: {question}\nA:"

    async def turn(self, url: str, question: str) -> None:
        """The question asked, and the reply taken into the conversation."""
        self.ask(question)
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            if self.endpoint == "chat":
                body = {**self.model, "messages": self.messages, "max_tokens": 4, "temperature": 0}
                reply = await client.post("/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text
                content = reply.json()["choices"][0]["message"].get("content") or ""
                self.messages.append({"role": "assistant", "content": content})
            else:
                body = {**self.model, "prompt": self.text, "n_predict": 4, "temperature": 0}
                reply = await client.post("/completion", json=body)
                assert reply.status_code == 200, reply.text
                self.text += reply.json()["content"]


async def swap(url: str) -> None:
    """The other model asked: under ``max_loaded = 1`` the first is unloaded, its slot kept."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        body = {"model": "other", "prompt": "Hello", "n_predict": 2, "temperature": 0}
        reply = await client.post("/completion", json=body)
    assert reply.status_code == 200, reply.text


def stored_more(model: Model, than: int) -> bool:
    return model.store_statistics().stores > than


def first_model(running: Running) -> Model:
    model: Model | None = running.daemon.models.get("first")
    assert model is not None
    return model


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
@pytest.mark.parametrize("name", NAMES)
async def test_every_turn_after_the_first_restores_the_conversation_across_a_swap_and_a_restart(
    short_dir: Path, tiny_models: Path, route_lines: RouteLines, name: str, endpoint: str
) -> None:
    path = model_file(tiny_models, name)
    store = short_dir / "store"
    conversation = Conversation(endpoint)
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(two_models(short_dir, path, store), providers_ready=True) as running:
            model = first_model(running)
            stores = model.store_statistics().stores
            await conversation.turn(running.url, QUESTIONS[0])
            await wait_until(partial(stored_more, model, stores))
            await swap(running.url)
            await conversation.turn(running.url, QUESTIONS[1])
            stores = first_model(running).store_statistics().stores
            await wait_until(partial(stored_more, first_model(running), stores))
        async with run_daemon(two_models(short_dir, path, store)) as running:
            await conversation.turn(running.url, QUESTIONS[2])
    first, other, second, third = route_lines.lines  # the other model's line between
    assert [line["model"] for line in route_lines.lines] == ["first", "other", "first", "first"]
    # The other model, loaded in the first's place: its own cold prefill.
    assert (other["route"], other["outcome"], other["restored_tokens"]) == ("plain", "ok", None), other
    assert other["load_ms"] is not None, other
    assert other["decoder_prompt_n"] == other["prompt_tokens"], other
    # The first turn, a tiny prompt, kept plain by the shipped cost decision (the priors price both
    # prefills alike and a handoff on top): the decoder prefilled all of it.  A first turn handed
    # over: test_a_first_turn_handed_over_leaves_the_decoder_one_token_or_a_hybrid_chat_its_generation_prompt.
    assert_cold(first, "plain-cheaper")
    for before, line in [(first, second), (second, third)]:
        # Restored from the store (the swap back, the restart), never prefilled again: the decoder
        # evaluated the new turn's tokens and at most the generation prompt and two more.
        assert line["restored_tokens"], line
        assert line["fallback"] == "stored" or line["route"] == "plain", line
        # Restored up to the generation prompt: a hybrid model's state ends there, and every chat's entry.
        generation_prompt = before["prompt_tokens"] - line["restored_tokens"]
        assert 0 <= generation_prompt <= GENERATION_PROMPT_MAX, (before, line)
        new = line["prompt_tokens"] - before["prompt_tokens"]
        assert line["decoder_prompt_n"] <= new + generation_prompt + 2, line
        # Whatever a provider prefilled is the rest after the restore, not the conversation again.
        assert line["route"] == "plain" or line["provider_prompt_n"] <= new + GENERATION_PROMPT_MAX, line


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
@pytest.mark.parametrize("name", NAMES)
async def test_a_first_turn_handed_over_leaves_the_decoder_one_token_or_a_hybrid_chat_its_generation_prompt(
    short_dir: Path, tiny_models: Path, route_lines: RouteLines, name: str, endpoint: str
) -> None:
    """The conversation's first turn on the file route (``route_by = "length"``: the shipped cost
    decision may keep a tiny prompt plain).  A dense or sliding-window model's state holds the whole
    prompt: the decoder evaluates its last token again, for the logits.  A hybrid model's ends at the
    boundary (routes/boundary.py): a raw prompt less its last token, which the decoder evaluates; a
    chat before the template's generation prompt, which the decoder evaluates, and a token more where
    the messages' last token merges with it (measured here: the decoder's render with and without it)."""
    conversation = Conversation(endpoint, model=None)
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(handing_over(short_dir, model_file(tiny_models, name)), providers_ready=True) as running:
            await conversation.turn(running.url, QUESTIONS[0])
            asked = conversation.messages[:-1]  # the reply taken off again
            client = running.daemon.models.default.client
            generation_prompt = await generation_prompt_n(client, asked) if endpoint == "chat" else 0
    [line] = route_lines.lines
    assert (line["route"], line["fallback"], line["outcome"]) == ("file", None, "ok"), line
    if FAMILIES[name] is Restores.PREFIX and endpoint == "chat":
        assert 0 < generation_prompt <= line["decoder_prompt_n"] <= generation_prompt + 1, (generation_prompt, line)
    else:
        assert line["decoder_prompt_n"] == 1, line


@pytest.mark.parametrize("name", ["llama-dense", "qwen35-dense", "lfm2-dense", "granitehybrid-dense"])
async def test_a_raw_conversation_drained_to_a_host_sharing_the_store_restores_there(
    short_dir: Path, tiny_models: Path, route_lines: RouteLines, name: str
) -> None:
    """Raw ``/completion`` turns, each prompt the last with its reply and a new question: two on one
    host, which then drains and stops; the third on another host sharing the prefix store restores
    the second (a token short: where the third still matches it) and evaluates only the new turn.
    (The chat's case: tests/real/test_real_families.py.)"""
    path = model_file(tiny_models, name)
    shared = short_dir / "shared"

    def host(name: str) -> Config:
        return make_config(
            short_dir / name,
            model={"path": str(path), "parallel": 2, "ctx_size": 4096},
            decoder={"threads": 1},
            cache={"dir": str(short_dir / f"store-{name}"), "shared_dir": str(shared), "min_tokens": 64, "ram_mib": 0},
            server={"host_id": name},
        )

    conversation = Conversation("completion", model=None)
    real_llama_server()
    try:
        with trio.fail_after(DEADLINE_S):
            async with run_daemon(host("a")) as running:
                model = running.daemon.models.default
                for question in QUESTIONS[:2]:
                    stores = model.store_statistics().stores
                    await conversation.turn(running.url, question)
                    await wait_until(partial(stored_more, model, stores))
            async with run_daemon(host("b")) as running:
                await conversation.turn(running.url, QUESTIONS[2])
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    first, second, third = route_lines.lines
    assert_cold(first)
    assert_went_on(first, second, generation_prompt=0)  # a raw prompt's continuation: no template
    assert (third["fallback"], third["origin_host"]) == ("stored", "a"), third
    # The second turn's entry a token short, or whole where the drain kept its slot and the third
    # turn's tokens still match it.
    assert second["prompt_tokens"] - 1 <= third["restored_tokens"] <= second["prompt_tokens"], (second, third)
    assert third["decoder_prompt_n"] <= third["prompt_tokens"] - second["prompt_tokens"] + 1 + 2, third
