"""Every model family and quant a user brings, through onebitd on the real llama-server (issue 32):
the tiny random-weight models of each architecture (scripts/tiny-models: dense, sliding-window,
hybrid recurrent and convolution, MoE), the dense one in the common quants (each quantized once from
its F32) and the shipped SmolLM2 (Q4_1).

Per model, on the embedded default config with ``model.path`` changed (and a provider, the file
route forced): what its load's probe found (supervisor/routes/capability.py); a long prompt asked,
asked again and asked after a restart is served with ``decoder_prompt_n <= 2`` on the hybrid route
and from the prefix store, or the capability is off with its reason on every route line; never a
request where a provider prefilled and the decoder then evaluated the prompt unsaid.  Then what each
family does where it differs: a sliding-window model without ``--swa-full`` (restore-unusable, no
provider job, no state file), a context over the training one (one warning, a 400 over-context), the
swap back under ``max_loaded = 1``, the share route, and a GGUF that is broken.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from supervisor.config import Config, locate
from supervisor.daemon import Daemon
from supervisor.llama import decoder
from supervisor.llama.decoder import JsonClient
from supervisor.models.model import Model
from supervisor.routes.capability import Restores
from supervisor.supervise.child import ChildState
from tests.rigs.helpers import wait_until
from tests.rigs.rig import (
    HANDOFF_ALWAYS,
    TESTS,
    RouteLines,
    child_of,
    make_config,
    openvino_llama_server,
    real_llama_server,
    run_daemon,
)

pytestmark = pytest.mark.real

DEADLINE_S = 240
# What each model's restore can do in this llama.cpp, as measured (docs/operations.md, "Model
# families"): sliding-window models with --swa-full (model.swa_full = "auto" turns it on).
FAMILIES = {
    "llama-dense": Restores.WHOLE,
    "llama-moe": Restores.WHOLE,
    "qwen3moe-moe": Restores.WHOLE,
    "gemma3-dense": Restores.WHOLE,
    "gpt-oss-moe": Restores.WHOLE,
    "qwen35-dense": Restores.PREFIX,
    "qwen35moe-moe": Restores.PREFIX,
    "granitehybrid-dense": Restores.PREFIX,
    "lfm2-dense": Restores.PREFIX,
    "lfm2-noswa-dense": Restores.PREFIX,
}
# The quant matrix: the tiny dense model quantized once from its F32 (scripts/tiny-models), and SmolLM2
# as shipped (Q4_1, the embedded default).  SmolLM2's other quants are re-quantized from that Q4_1,
# so not here: a quant's routes do not hang on a real model's reply (scripts/bench families times them).
QUANTS = {f"llama-dense.{q}": Restores.WHOLE for q in ("F16", "Q8_0", "Q6_K", "Q4_K_M", "Q4_1", "Q4_0")}
QUANTS["SmolLM2-135M-Instruct.Q4_1"] = Restores.WHOLE
MODELS = {**FAMILIES, **QUANTS}
# About 300 tokens of the tiny models' vocabulary (5 bytes a token), 600 of SmolLM2's.
PROMPT = " ".join(f"item {i} weighs {i * 7 % 13} units" for i in range(80))


@pytest.fixture(scope="module")
def tiny_models() -> Path:
    """The directory scripts/tiny-models wrote (set-up made it); the suite fails without it."""
    found = subprocess.run(
        [str(TESTS.parent / "scripts" / "tiny-models"), "--print-path", sys.executable],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    path = Path(found)
    if not (path / "llama-dense.gguf").is_file():
        pytest.fail(f"no tiny models in {path}: run scripts/setup (it makes them)")
    return path


@pytest.fixture
def store_dir(short_dir: Path) -> Iterator[Path]:
    path = short_dir / "store"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def config(runtime: Path, model_path: Path, store: Path, *, with_provider: bool = True, **changes: Any) -> Config:
    real_llama_server()
    sections: dict[str, Any] = {
        "model": {"path": str(model_path), "parallel": 2, "ctx_size": 4096, **changes.pop("model", {})},
        "decoder": {"threads": 1, **changes.pop("decoder", {})},
        "cache": {"dir": str(store), "min_tokens": 64, "ram_mib": 0, **changes.pop("cache", {})},
    }
    if with_provider:
        sections["hybrid"] = {"enabled": True, "min_prompt_tokens": 16, **HANDOFF_ALWAYS}
        sections["provider"] = [{"kind": "llama-server", "name": "p0", "threads": 1}]
    return make_config(runtime, **{**sections, **changes})


async def ask(url: str, prompt: str = PROMPT, *, status: int = 200) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        reply = await client.post("/completion", json={"prompt": prompt, "n_predict": 4, "temperature": 0})
    assert reply.status_code == status, reply.text
    return dict(reply.json())


def jobs(daemon: Daemon) -> int:
    return sum(p.statistics().jobs for p in daemon.models.default.parts.providers.all)


def kept_files(store: Path) -> list[Path]:
    """The prefix store's entries on disk (none where the store is off)."""
    return sorted(store.rglob("*.state")) if store.exists() else []


async def generation_prompt_n(client: JsonClient, messages: list[dict[str, str]]) -> int:
    """The tokens the chat template's generation prompt adds to ``messages``, as the decoder renders
    and tokenizes them with it and without it (routes/boundary.py's find)."""
    counts = []
    for add in (True, False):
        text = await decoder.apply_template(client, {"messages": messages, "add_generation_prompt": add})
        counts.append(len(await decoder.tokenize(client, text)))
    return counts[0] - counts[1]


def assert_cold(line: dict[str, Any], fallback: str | None = None) -> None:
    """A conversation's first request, nothing of it anywhere: the decoder prefilled all of it."""
    assert (line["route"], line["fallback"], line["outcome"]) == ("plain", fallback, "ok"), line
    assert line["restored_tokens"] is None, line
    assert line["decoder_prompt_n"] == line["prompt_tokens"], line


def assert_went_on(before: dict[str, Any], line: dict[str, Any], generation_prompt: int) -> None:
    """A conversation's next request, in the same onebitd: restored from the store (a hybrid's slot
    holds its state past where this turn parts) or reused from the slot (a dense model's), and the
    decoder evaluated the new turn's tokens and at most the generation prompt and two more."""
    assert (line["route"], line["outcome"]) == ("plain", "ok"), line
    if line["restored_tokens"] is not None:
        assert line["fallback"] == "stored", line
    else:
        assert line["fallback"] is None, line
        assert line["cached_tokens"] >= before["prompt_tokens"] - generation_prompt - 2, line
    new = line["prompt_tokens"] - before["prompt_tokens"]
    assert line["decoder_prompt_n"] <= new + generation_prompt + 2, (before, line)


def model_file(tiny_models: Path, name: str) -> Path:
    """A tiny model's file, or the embedded default (Q4_1, which set-up installs, not re-quantizes)."""
    embedded = locate.embedded_model()
    path = embedded if embedded is not None and embedded.stem == name else tiny_models / f"{name}.gguf"
    assert path.is_file(), path
    return path


@pytest.mark.parametrize("name", list(MODELS))
async def test_a_long_prompt_asked_again_and_after_a_restart_is_never_paid_for_twice(
    short_dir: Path, store_dir: Path, tiny_models: Path, route_lines: RouteLines, name: str
) -> None:
    expected = MODELS[name]
    path = model_file(tiny_models, name)
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config(short_dir, path, store_dir), providers_ready=True) as running:
            model = running.daemon.models.default
            assert model.parts.capability.restores is expected, model.parts.capability.why
            first = await ask(running.url)
            again = await ask(running.url)
            stats = model.statistics()
            await wait_until(lambda: model.store_statistics().stores >= 1)
        # After a restart: no provider, the prefix store alone spares the prompt, or is off.
        async with run_daemon(config(short_dir, path, store_dir, with_provider=False)) as running:
            after = await ask(running.url)
    assert all(reply["content"] for reply in (first, again, after))
    asked, asked_again, restarted = route_lines.lines
    for line in (asked, asked_again):
        # Handed over: the decoder evaluated one token, never the prompt.  llama-server keeps the last
        # token back to compute the next token's logits from: a state that holds the whole prompt (a
        # dense or sliding-window model's) has it evaluated again; a hybrid's ends at the raw prompt's
        # boundary, that token short (routes/boundary.py), and the decoder evaluates it.  Either way one.
        assert (line["route"], line["fallback"], line["outcome"]) == ("file", None, "ok"), line
        assert line["decoder_prompt_n"] == 1, line
        assert line["prompt_tokens"] >= 200
    assert stats.restores == expected.value
    # Every model's entry ends where the next turn still matches it (routes/boundary.py's entry_end):
    # a raw prompt less its last token, whose tokens may merge with the reply's first.
    kept = asked["prompt_tokens"] - 1
    assert (restarted["fallback"], restarted["restored_tokens"]) == ("stored", kept)
    assert restarted["decoder_prompt_n"] == 1, restarted  # the token the entry leaves out


async def test_a_sliding_window_model_without_swa_full_turns_its_restores_off_and_says_so_everywhere(
    short_dir: Path, store_dir: Path, tiny_models: Path, route_lines: RouteLines, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="onebit.model")
    path = model_file(tiny_models, "gemma3-dense")
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config(short_dir, path, store_dir, model={"swa_full": False})) as running:
            model = running.daemon.models.default
            assert "--swa-full" not in model.parts.launcher.argv()
            await ask(running.url)
            await ask(running.url)
            async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
                health = (await client.get("/health")).json()
            assert jobs(running.daemon) == 0
            assert list((short_dir / "state").iterdir()) == []
            stats = model.statistics()
    assert model.parts.capability.restores is Restores.NONE
    for line in route_lines.lines:
        assert (line["route"], line["fallback"]) == ("plain", "restore-unusable"), line
    said = [r.getMessage() for r in caplog.records if "restores none" in r.getMessage()]
    assert len(said) == 1
    assert said[0].startswith("model gemma3-dense: restores none: a restored state re-evaluated the prompt")
    assert "model.swa_full = true" in said[0]
    assert health["restores_unusable"]["gemma3-dense"].startswith("none: ")
    assert (stats.restores, stats.swa_full) == ("none", False)
    assert kept_files(store_dir) == []


async def test_a_context_over_the_training_one_is_warned_once_and_an_over_long_prompt_is_over_context(
    short_dir: Path, store_dir: Path, tiny_models: Path, route_lines: RouteLines, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="onebit.model")
    path = model_file(tiny_models, "llama-dense")
    # The model as trained for 256 tokens: each of the two slots gets 256, not 2048.
    trained = {"extra_args": ["--override-kv", "llama.context_length=int:256"]}
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config(short_dir, path, store_dir, decoder=trained), providers_ready=True) as running:
            reply = await ask(running.url, status=400)
            assert jobs(running.daemon) == 0
            slot_context = running.daemon.models.default.statistics().slot_context
    assert reply["error"]["type"] == "exceed_context_size_error"
    [line] = route_lines.lines
    assert (line["route"], line["fallback"], line["status"]) == ("plain", "over-context", 400)
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.name == "onebit.model" and r.levelno == logging.WARNING and "training context" in r.getMessage()
    ]
    assert warned == [
        "model llama-dense: model.ctx_size = 4096 over model.parallel = 2 asks 2048 tokens a slot, over the"
        " model's training context of 256: each slot got 256 tokens"
    ]
    assert slot_context == 256


def several(runtime: Path, first: Path, store: Path, cache: dict[str, Any] | None = None, **first_table: Any) -> Config:
    real_llama_server()
    other = locate.embedded_model()
    assert other is not None
    tables = [
        {"name": "first", "path": str(first), "parallel": 1, "ctx_size": 2048, **first_table},
        {"name": "other", "path": str(other), "parallel": 1, "ctx_size": 2048, "preload": False},
    ]
    return make_config(
        runtime,
        model=tables,
        models={"max_loaded": 1},
        decoder={"threads": 1},
        cache={"dir": str(store), "min_tokens": 64, "ram_mib": 0, **(cache or {})},
    )


async def ask_model(url: str, model: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        reply = await client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(
    ("name", "table", "kept"),
    [("llama-dense", {}, 0), ("qwen35-dense", {}, 1), ("gemma3-dense", {"swa_full": False}, None)],
    ids=["dense", "hybrid", "swa-without-swa-full"],
)
async def test_a_model_swapped_out_and_back_restores_its_prompt_or_was_swapped_without_a_save(
    short_dir: Path,
    store_dir: Path,
    tiny_models: Path,
    route_lines: RouteLines,
    name: str,
    table: dict[str, Any],
    kept: int | None,
) -> None:
    """``kept``: how many of the prompt's last tokens its entry leaves out (a hybrid model's ends at
    its boundary); None: nothing is kept."""
    path = model_file(tiny_models, name)
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(several(short_dir, path, store_dir, **table)) as running:
            await ask_model(running.url, "first")
            await ask_model(running.url, "other")  # max_loaded = 1: the first is unloaded
            await ask_model(running.url, "first")  # and loaded back
            first = running.daemon.models.get("first")
            assert first is not None
            entries = first.store_statistics().entries
    cold, other, back = route_lines.lines
    assert_cold(cold, None if kept is not None else "restore-unusable")
    # The other model, loaded in its place: its own cold prefill.
    assert (other["model"], other["route"], other["restored_tokens"]) == ("other", "plain", None), other
    assert other["load_ms"] is not None, other
    assert other["decoder_prompt_n"] == other["prompt_tokens"], other
    assert (cold["model"], back["model"]) == ("first", "first")
    assert back["load_ms"] is not None, back  # loaded back
    if kept is not None:
        assert back["restored_tokens"] == cold["prompt_tokens"] - kept
        assert back["decoder_prompt_n"] <= 2, back
        assert back["fallback"] == "stored", back
    else:
        # Swapped without a save: no entry, and the prompt prefilled once again, said so.
        assert entries == 0
        assert back["restored_tokens"] is None
        assert back["decoder_prompt_n"] == back["prompt_tokens"]
        assert back["fallback"] == "restore-unusable"


def stored_more(model: Model, than: int) -> bool:
    return model.store_statistics().stores > than


SYSTEM = "You answer questions about a warehouse inventory. " + PROMPT


async def streamed_chat_turn(url: str, messages: list[dict[str, str]], model: str) -> str:
    """One chat turn streamed, as an agent asks: its reply's content."""
    body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}
    content: list[str] = []
    async with (
        httpx.AsyncClient(base_url=url, timeout=120) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as reply,
    ):
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                content += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    return "".join(content)


@pytest.mark.parametrize("name", ["llama-dense", "qwen35-dense"], ids=["dense", "hybrid"])
async def test_a_chat_swapped_out_after_its_first_turn_restores_its_second_turn(
    short_dir: Path, store_dir: Path, tiny_models: Path, route_lines: RouteLines, name: str
) -> None:
    """``scripts/bench turns --quick``'s shape on the embedded config's store and prompt cache: a short
    chat first, a conversation's first turn, the other model asked (``max_loaded = 1`` unloads the
    first) and the conversation's second turn, which restores the first from the store.  Every chat's
    entry ends before its generation prompt: the tiny llama model tokenizes the "\n" that prompt ends
    with merged with the reply's first digits when the next turn re-renders it, and an entry holding
    the whole first prompt was no prefix of the second (it restored nothing and said nothing)."""
    path = model_file(tiny_models, name)
    bench_like = {"parallel": 2, "ctx_size": 8192}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How heavy is item 7?"}]
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(
            several(short_dir, path, store_dir, cache={"min_tokens": 256, "ram_mib": 1024}, **bench_like)
        ) as running:
            first = running.daemon.models.get("first")
            assert first is not None
            await streamed_chat_turn(running.url, [{"role": "user", "content": "Say hi."}], "first")
            stores = first.store_statistics().stores
            messages.append({"role": "assistant", "content": await streamed_chat_turn(running.url, messages, "first")})
            messages.append({"role": "user", "content": "And item 9?"})
            await wait_until(partial(stored_more, first, stores))
            await streamed_chat_turn(running.url, [{"role": "user", "content": "Say hello."}], "other")
            await streamed_chat_turn(running.url, messages, "first")
    hi, cold, other, back = route_lines.lines
    for line in (hi, cold):
        assert_cold(line)
    assert (other["model"], other["route"], other["restored_tokens"]) == ("other", "plain", None), other
    assert other["decoder_prompt_n"] == other["prompt_tokens"], other
    assert back["fallback"] == "stored", back
    # Restored: the first turn up to its generation prompt ("<|im_start|>assistant\n", a few tokens).
    assert 0 < cold["prompt_tokens"] - back["restored_tokens"] <= 8, (cold, back)
    assert back["decoder_prompt_n"] <= back["prompt_tokens"] - back["restored_tokens"] + 2, back


async def chat_turn(url: str, messages: list[dict[str, str]]) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        body = {"messages": messages, "max_tokens": 4, "temperature": 0}
        reply = await client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"].get("content") or "")


@pytest.mark.parametrize("name", ["qwen35-dense", "lfm2-dense", "granitehybrid-dense", "llama-dense"])
async def test_a_conversations_third_turn_after_a_restart_restores_it_and_evaluates_only_the_new_turn(
    short_dir: Path, store_dir: Path, tiny_models: Path, route_lines: RouteLines, name: str
) -> None:
    """A chat of three turns on the plain route, onebitd restarted before the third: the store keeps
    each turn before the template's generation prompt, where the next turn still matches it, and the
    third restores the second's and evaluates the new turn's tokens and the
    generation prompt, nothing more."""
    path = model_file(tiny_models, name)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How heavy is item 7?"}]
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config(short_dir, path, store_dir, with_provider=False)) as running:
            model = running.daemon.models.default
            stored = model.parts.completions.stored
            assert stored is not None
            assert stored.enabled, model.parts.capability.words  # on for every family that restores
            generation_prompt = await generation_prompt_n(model.client, messages)
            for question in ["And item 9?", "And item 12?"]:
                stores = model.store_statistics().stores
                messages += [{"role": "assistant", "content": await chat_turn(running.url, messages)}]
                messages += [{"role": "user", "content": question}]
                await wait_until(partial(stored_more, model, stores))
        async with run_daemon(config(short_dir, path, store_dir, with_provider=False)) as running:
            await chat_turn(running.url, messages)
    first, second, third = route_lines.lines
    assert_cold(first)
    assert_went_on(first, second, generation_prompt)
    assert third["fallback"] == "stored", third
    new = third["prompt_tokens"] - second["prompt_tokens"]
    # Restored: the second turn up to its generation prompt ("<|im_start|>assistant\n", a few tokens).
    generation_prompt = second["prompt_tokens"] - third["restored_tokens"]
    assert 0 < generation_prompt <= 8, (second, third)
    assert third["decoder_prompt_n"] <= new + generation_prompt + 2, third


@pytest.mark.parametrize("name", ["llama-dense", "qwen35-dense", "lfm2-dense", "granitehybrid-dense"])
async def test_a_conversation_drained_to_a_host_sharing_the_store_restores_there_and_evaluates_only_the_new_turn(
    short_dir: Path, tiny_models: Path, route_lines: RouteLines, name: str
) -> None:
    """Two turns on one host, which then drains and stops; the third on another host sharing its
    prefix store (``cache.shared_dir``) restores the second turn up to its generation prompt and
    evaluates only the new turn's tokens and the generation prompt."""
    path = model_file(tiny_models, name)
    shared = short_dir / "shared"

    def host(name: str) -> Config:
        store, cache = short_dir / f"store-{name}", {"shared_dir": str(shared)}
        return config(short_dir / name, path, store, with_provider=False, cache=cache, server={"host_id": name})

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How heavy is item 7?"}]
    try:
        with trio.fail_after(DEADLINE_S):
            async with run_daemon(host("a")) as running:
                model = running.daemon.models.default
                generation_prompt = await generation_prompt_n(model.client, messages)
                for question in ["And item 9?", "And item 12?"]:
                    stores = model.store_statistics().stores
                    messages += [{"role": "assistant", "content": await chat_turn(running.url, messages)}]
                    messages += [{"role": "user", "content": question}]
                    await wait_until(partial(stored_more, model, stores))
            async with run_daemon(host("b")) as running:
                await chat_turn(running.url, messages)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    first, second, third = route_lines.lines
    assert_cold(first)
    assert_went_on(first, second, generation_prompt)
    assert (third["fallback"], third["origin_host"]) == ("stored", "a"), third
    # Restored up to the second turn's generation prompt (its entry ends there, where the third parts),
    # a token more where the messages' last token merges with it (routes/boundary.py's find).
    assert generation_prompt <= second["prompt_tokens"] - third["restored_tokens"] <= generation_prompt + 1, third
    assert third["decoder_prompt_n"] <= third["prompt_tokens"] - second["prompt_tokens"] + generation_prompt + 2, third


def share_config(runtime: Path, model_path: Path, store: Path) -> Config:
    """The share route on, its provider the llama-server one (it writes rows into the lent region)."""
    return config(
        runtime,
        model_path,
        store,
        hybrid={"enabled": True, "min_prompt_tokens": 16, "mode": "share", **HANDOFF_ALWAYS},
    )


@pytest.mark.parametrize(
    ("name", "memory"),
    [
        ("llama-dense", None),
        ("qwen3moe-moe", None),
        ("gemma3-dense", "kv+swa"),
        ("qwen35-dense", None),
        ("granitehybrid-dense", None),
        ("lfm2-noswa-dense", None),
        ("lfm2-dense", "kv+swa+recurrent"),
    ],
)
async def test_the_share_route_adopts_where_the_decoder_can_lend_that_memory_and_else_says_why(
    short_dir: Path,
    store_dir: Path,
    tiny_models: Path,
    route_lines: RouteLines,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    memory: str | None,
) -> None:
    monkeypatch.delenv("ONEBIT_KV_SHARE", raising=False)
    path = model_file(tiny_models, name)
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(share_config(short_dir, path, store_dir)) as running:
            worker = running.daemon.models.default.parts.providers.all[0]
            await child_of(worker).wait_state(ChildState.READY)
            await ask(running.url)
            await ask(running.url, "Another conversation altogether. " + PROMPT)
            async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
                refused = (await client.get("/health")).json().get("share_refused", {})
            model = running.daemon.models.default.name
    first, second = route_lines.lines
    # A refusal is said per model while that decoder runs, with the memory it cannot lend.
    assert refused.keys() == (set() if memory is None else {model}), refused
    assert memory is None or refused[model].endswith(f"(memory {memory})"), refused
    if memory is None:
        # A hybrid's recurrent state is lent beside its KV: handed over at the raw prompt's boundary
        # (less its last token), the decoder evaluates that one.
        assert (first["route"], first["fallback"], first["decoder_prompt_n"]) == ("share", None, 1), first
        assert (first["memory"], second["memory"]) == (None, None), second
    else:
        # The decoder refuses to lend what it cannot (a sliding window's memory): the file route
        # follows before any prefill, and the decoder still evaluates a token or two.  Every request
        # the refusal sends there says so and names the memory, not only the one that asked.
        for line, fallback in ((first, "share-refused"), (second, "share-refused-earlier")):
            assert (line["route"], line["fallback"], line["memory"]) == ("file", fallback, memory), line
            assert line["decoder_prompt_n"] <= 2, line


def _renamed_architecture(source: Path, target: Path) -> None:
    """``source`` with its ``general.architecture`` value renamed to one this llama.cpp lacks."""
    data = source.read_bytes()
    key = data.index(b"general.architecture")
    value = data.index(b"llama", key + len(b"general.architecture"))
    target.write_bytes(data[:value] + b"llamb" + data[value + 5 :])


async def test_a_model_of_an_architecture_this_llama_cpp_lacks_fails_at_once_with_one_line(
    short_dir: Path, store_dir: Path, tiny_models: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="onebit.child")
    path = short_dir / "unknown.gguf"
    _renamed_architecture(model_file(tiny_models, "llama-dense"), path)
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config(short_dir, path, store_dir, with_provider=False), wait_ready=False) as running:
            decoder = running.daemon.models.default.decoder
            assert await decoder.wait_state(ChildState.FAILED, ChildState.READY) is ChildState.FAILED
            stats = decoder.statistics()
            async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
                health = await client.get("/health")
    # One start, no restart, no backoff: a load error no restart can mend.
    assert (stats.restarts, health.status_code, health.json()) == (0, 503, {"status": "failed"})
    assert stats.last_exit is not None
    assert stats.last_exit.startswith(f"model.path {path}: llama-server cannot load it: unknown model architecture")
    failed = [r.getMessage() for r in caplog.records if r.name == "onebit.child" and "-> failed" in r.getMessage()]
    assert len(failed) == 1
    assert not [r for r in caplog.records if "-> backoff" in r.getMessage()]


async def test_a_family_the_openvino_backend_cannot_compute_is_refused_with_one_line_and_auto_goes_on_with_ggml(
    short_dir: Path, store_dir: Path, tiny_models: Path, route_lines: RouteLines, caplog: pytest.LogCaptureFixture
) -> None:
    # Measured (docs/benchmarks.md, "families"): OpenVINO answers a sliding-window model's prefill
    # with "Compute error"; engine "auto" refuses it at start and goes on with the ggml engine.
    openvino_llama_server()
    caplog.set_level(logging.INFO, logger="onebit.provider")
    path = model_file(tiny_models, "gemma3-dense")
    provider = {"kind": "llama-server", "name": "ov", "engine": "auto", "device": "CPU", "threads": 1}
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(
            config(short_dir, path, store_dir, provider=[provider], cache={"compile_dir": str(short_dir / "ovc")}),
        ) as running:
            (made,) = running.daemon.models.default.parts.providers.all
            await made.wait_settled()
            await wait_until(lambda: made.ready)
            stats = made.statistics()
            await ask(running.url)
    said = [r.getMessage() for r in caplog.records if "OpenVINO refused for this model" in r.getMessage()]
    assert len(said) == 1
    assert "it cannot prefill this model: provider failed: ov: prefill answered 500: Compute error" in said[0]
    assert (stats.engine, stats.refused) == ("ggml", None)
    [line] = route_lines.lines
    assert (line["route"], line["engine"], line["decoder_prompt_n"]) == ("file", "ggml", 1), line
