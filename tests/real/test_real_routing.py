"""Cache-aware routing against the real parts: a chat's later turns stay plain, because the decoder's
slot already holds the conversation, and interleaved chats keep their slots.

The reference for every reply is the same decoder, with the same flags, answering the same turns
from its own prompt cache: llama.cpp's greedy output can depend on how a prompt was split into
batches, so a cold prefill is not the reference for a handed-over or a cached turn.  The reference
run talks to its decoder directly, one slot per chat; a chat's first turn is primed with all but
its last token, as a handoff leaves the slot, and later turns reuse the slot's cache as onebitd's do.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from supervisor.config import Config
from supervisor.supervise.child import ChildState
from tests.rigs.helpers import CHAT
from tests.rigs.rig import RouteLines, child_of, make_config, real_llama_server, run_daemon

pytestmark = pytest.mark.real

SYSTEMS = {
    "pirate": "You are a cheerful pirate who answers every question about the sea. "
    "You speak in short sentences, you never use more than twenty words, and you always mention "
    "your ship, the Salty Gull, and her three masts, her red sails and her old brass bell. ",
    "baker": "You are a patient baker who explains bread to beginners. "
    "You speak plainly, you never use more than twenty words, and you always mention "
    "flour, water, salt and yeast, and how long the dough should rest before it is baked. ",
}
QUESTIONS = ["Who are you?", "What do you like best?", "What did you do yesterday?", "Say goodbye."]


@pytest.fixture
def second_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ob-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def config(runtime: Path, *, hybrid: bool) -> Config:
    real_llama_server()
    return make_config(
        runtime,
        model={"parallel": 2, "ctx_size": 2048},
        # Pinned apart: the provider computes apart from the decoder, so a cold prompt's near-tie
        # goes to it (on shared cores only a cheaper first token would).
        decoder={"threads": 1, "cpu_affinity": [0]},
        # Turn 1 prompts are 66-74 tokens; a later turn adds about 30 (a reply of 12, a question).
        hybrid={"enabled": hybrid, "min_prompt_tokens": 48},
        provider=[{"kind": "llama-server", "name": "p0", "threads": 1, "cpu_affinity": [1]}] if hybrid else [],
    )


def conversation(name: str, turn: int, history: list[str]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEMS[name]}]
    for asked, answer in zip(QUESTIONS[:turn], history, strict=False):
        messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": answer}]
    return [*messages, {"role": "user", "content": QUESTIONS[turn]}]


def body_for(messages: list[dict[str, Any]], turn: int) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": 12, "temperature": 0, "stream": turn % 2 == 1}


async def reference(socket: Path) -> dict[str, list[str]]:
    """Both chats straight to the decoder, each on a slot of its own, every turn from its cache."""
    got: dict[str, list[str]] = {name: [] for name in SYSTEMS}
    # A connection per request: this client is not what is under test, and a pooled connection that
    # llama-server closed in between would fail it.
    transport = httpx.AsyncHTTPTransport(uds=str(socket), limits=httpx.Limits(max_keepalive_connections=0))
    async with httpx.AsyncClient(transport=transport, base_url="http://decoder", timeout=120) as direct:
        for turn in range(len(QUESTIONS)):
            for slot, name in enumerate(SYSTEMS):
                messages = conversation(name, turn, got[name])
                if turn == 0:
                    prompt = (await direct.post("/apply-template", json={"messages": messages})).json()["prompt"]
                    tokenized = {"content": prompt, "add_special": True, "parse_special": True}
                    tokens = (await direct.post("/tokenize", json=tokenized)).json()["tokens"]
                    primed = {"prompt": tokens[:-1], "n_predict": 0, "id_slot": slot, "cache_prompt": True}
                    assert (await direct.post("/completion", json=primed)).status_code == 200
                got[name].append(await ask(direct, {**body_for(messages, turn), "id_slot": slot}))
    return got


async def converse(url: str, replies: dict[str, list[str]]) -> dict[str, list[str]]:
    """Both chats through onebitd, turn by turn, interleaved; each turn re-sends the conversation
    (the reference's replies, so both runs send the very same messages)."""
    got: dict[str, list[str]] = {name: [] for name in SYSTEMS}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for turn in range(len(QUESTIONS)):
            for name in SYSTEMS:
                got[name].append(await ask(client, body_for(conversation(name, turn, replies[name]), turn)))
    return got


async def ask(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
    if not body["stream"]:
        reply = await client.post(CHAT, json=body)
        assert reply.status_code == 200, reply.text
        return str(reply.json()["choices"][0]["message"]["content"])
    text = ""
    async with client.stream("POST", CHAT, json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text += choice.get("delta", {}).get("content") or ""
    return text


async def test_a_chats_later_turns_stay_plain_because_the_decoder_holds_them_and_replies_equal_plain(
    short_dir: Path, second_dir: Path, route_lines: RouteLines, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="onebit.hybrid")
    with trio.fail_after(420):
        async with run_daemon(config(second_dir, hybrid=False)) as running:
            expected = await reference(running.daemon.models.default.parts.launcher.socket)
        async with run_daemon(config(short_dir, hybrid=True)) as running:
            await child_of(running.daemon.models.default.parts.providers.all[0]).wait_state(ChildState.READY)
            got = await converse(running.url, expected)
    lines = route_lines.lines
    differ = [
        (name, turn, got[name][turn], expected[name][turn])
        for name in SYSTEMS
        for turn in range(len(QUESTIONS))
        if got[name][turn] != expected[name][turn]
    ]
    assert not differ, (differ, [(line["route"], line["fallback"]) for line in lines])
    assert len(lines) == 2 * len(QUESTIONS)
    first, later = lines[:2], lines[2:]
    # Turn 1 of each chat: nothing cached anywhere, so the provider prefills and hands it over.
    assert [(line["route"], line["fallback"]) for line in first] == [("file", None)] * 2
    assert all(line["decoder_prompt_n"] <= 2 for line in first)
    # Turns 2..4: the slot holds the conversation so far; the handoff would only cost.
    assert [(line["route"], line["fallback"]) for line in later] == [("plain", "cached")] * len(later)
    for line in later:
        assert line["est_plain_ms"] is not None  # weighed, and the floor on what the slot lacks decided
        assert line["cached_tokens"] >= line["prompt_tokens"] // 2
        assert line["decoder_prompt_n"] < 40, line  # the new turn, not the conversation
    # Interleaved chats keep their slots: each chat's turns on one slot, the two chats on two.
    slots = {name: {line["slot"] for line in lines[i::2]} for i, name in enumerate(SYSTEMS)}
    assert all(len(s) == 1 for s in slots.values()), slots
    assert slots["pirate"] != slots["baker"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "onebit.hybrid"]
