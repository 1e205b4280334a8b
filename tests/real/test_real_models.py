"""Several models against the real llama-server: the shipped GGUF served under two names with different
ctx_size, loaded on demand, swapped within max_loaded = 1 without losing a conversation's prompt (the
next turn restores it from the prefix store), never unloaded under a request, unloaded when idle past
ttl_s, loaded or unloaded by onebitctl, and one ggml provider both name, handed over to each in turn."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from supervisor.admin import verbs as admin
from supervisor.models.model import ModelState
from supervisor.providers.seat import Tenant
from tests.rigs.helpers import wait_until
from tests.rigs.rig import HANDOFF_ALWAYS, RouteLines, Running, make_config, real_llama_server, run_daemon

pytestmark = pytest.mark.real

DEADLINE_S = 240
# Two models from one GGUF: "big" (the default) with two slots of 1024 tokens, "small" with one of
# 1024; another ctx_size makes another fingerprint, and another prefix store.
TABLES = [
    {"name": "big", "aliases": ["b"], "ctx_size": 2048, "parallel": 2},
    {"name": "small", "aliases": ["s"], "ctx_size": 1024, "parallel": 1},
]
# About 350 tokens: long enough to be kept in the prefix store (cache.min_tokens 64 here).
LONG = "Here is a list of words to remember. " + " ".join(f"word{i}" for i in range(100))
GREEDY = {"n_predict": 8, "temperature": 0, "seed": 1}


def config_for(short_dir: Path, *, tables: list[dict[str, Any]] | None = None, **models: Any) -> Any:
    return make_config(
        short_dir,
        model=tables or TABLES,
        models=models,
        decoder={"threads": 1},
        # llama-server's own in-memory prompt cache off: the prefix store must be what serves a swap.
        cache={"ram_mib": 0, "min_tokens": 64},
    )


@asynccontextmanager
async def serving(short_dir: Path, **models: Any) -> AsyncIterator[tuple[Running, httpx.AsyncClient]]:
    real_llama_server()
    tables = models.pop("tables", None)
    async with (
        run_daemon(config_for(short_dir, tables=tables, **models)) as running,
        httpx.AsyncClient(base_url=running.url, timeout=DEADLINE_S) as client,
    ):
        # run_daemon waits for the default decoder; its model is loaded once its owner task saw that.
        await running.daemon.models.default.wait_state(ModelState.LOADED)
        yield running, client


def leftovers(runtime: Path, pids: list[int]) -> tuple[list[str], list[int]]:
    """The files a stopped onebitd left outside its prefix stores, and its children still there."""
    files = sorted(str(p.relative_to(runtime)) for p in runtime.rglob("*") if not p.is_dir())
    return [f for f in files if not f.startswith("prefix/")], [pid for pid in pids if Path(f"/proc/{pid}").exists()]


async def complete(client: httpx.AsyncClient, model: str | None, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, **GREEDY, **extra, **({"model": model} if model else {})}
    reply = await client.post("/completion", json=body)
    assert reply.status_code == 200, reply.text
    data: dict[str, Any] = reply.json()
    return data


def states(listing: dict[str, Any]) -> dict[str, str]:
    return {entry["id"]: entry["status"]["value"] for entry in listing["data"]}


async def test_two_models_answer_by_name_and_alias_and_v1_models_lists_their_states(
    short_dir: Path, route_lines: RouteLines
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with serving(short_dir) as (running, client):
            listing = (await client.get("/v1/models")).json()
            assert states(listing) == {"big": "loaded", "small": "unloaded"}
            assert [entry["aliases"] for entry in listing["data"]] == [["b"], ["s"]]

            await complete(client, None, "The sky is")  # no model: the default
            await complete(client, "s", "The sky is")  # loaded on demand, by its alias
            assert states((await client.get("/v1/models")).json()) == {"big": "loaded", "small": "loaded"}
            first, second = (await route_lines.until(2))[-2:]
            assert (first["model"], first["load_ms"]) == ("big", None)
            assert second["model"] == "small"
            assert second["load_ms"] > 0

            unknown = await client.post("/v1/chat/completions", json={"model": "gpt-4", "messages": []})
            assert unknown.status_code == 404
            error = unknown.json()["error"]
            assert error["code"] == "model_not_found"
            assert "big" in error["message"]
            assert "small" in error["message"]
            pids = [child.pid for child in running.daemon.children() if child.pid is not None]
            assert len(pids) == 2
        # No child, socket or state file left.
        assert leftovers(short_dir, pids) == ([], [])


async def test_a_swap_within_max_loaded_keeps_the_conversation_in_the_prefix_store(
    short_dir: Path, route_lines: RouteLines
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with serving(short_dir, max_loaded=1) as (running, client):
            turn1 = await complete(client, "big", LONG)
            await complete(client, "small", "The sky is")  # big is swapped out for it
            big = running.daemon.models.get("big")
            assert big is not None
            assert big.state is ModelState.UNLOADED
            assert big.store_statistics().entries >= 1
            # Each model's store of its own (another ctx_size, another fingerprint): onebitctl cache list --model.
            path = running.daemon.admin.path
            listed = {name: await admin.call(path, "cache list", {"model": name}) for name in ("big", "small")}
            assert len(listed["big"]["result"]["entries"]) == big.store_statistics().entries
            assert listed["small"]["result"]["entries"] == []
            assert listed["big"]["result"]["statistics"]["directory"].endswith("model-big")
            unknown = await admin.call(path, "cache list", {"model": "nope"})
            assert unknown["ok"] is False
            turn2 = await complete(client, "big", LONG + turn1["content"] + " Now say word42.")
            assert turn2["content"]
            line = (await route_lines.until(3))[-1]
            assert line["model"] == "big"
            assert line["load_ms"] > 0
            # Restored from the store: the decoder prefilled only what is new.
            assert line["restored_tokens"] >= 250
            assert line["decoder_prompt_n"] < 50
            assert running.daemon.models.swaps == 2
            assert states((await client.get("/v1/models")).json()) == {"big": "loaded", "small": "unloaded"}
            # A relayed GET that names no model goes to a loaded one: it swaps nothing in.
            await complete(client, "small", "The sky is")
            props = await client.get("/props")
            assert props.status_code == 200
            assert props.json()["model_alias"] == "small"
            assert running.daemon.models.swaps == 3


async def test_a_model_in_use_is_not_unloaded_under_its_request(short_dir: Path, route_lines: RouteLines) -> None:
    with trio.fail_after(DEADLINE_S):
        async with serving(short_dir, max_loaded=1) as (running, client):
            models = running.daemon.models
            body = {"prompt": "Count from one to fifty:", "n_predict": 64, "temperature": 0, "stream": True}
            async with client.stream("POST", "/completion", json={**body, "model": "big"}) as stream:
                chunks = stream.aiter_bytes()
                await chunks.__anext__()  # big is decoding for it

                async def for_small() -> None:
                    await complete(client, "small", "The sky is")

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(for_small)
                    await wait_until(lambda: models.statistics().waiting == 1)
                    big = models.get("big")
                    assert big is not None
                    assert big.state is ModelState.LOADED
                    async for _chunk in chunks:
                        pass
            assert stream.status_code == 200
            streamed, small = sorted((await route_lines.until(2))[-2:], key=lambda line: line["model"])
            assert (streamed["model"], streamed["outcome"], streamed["status"]) == ("big", "ok", 200)
            assert small["model"] == "small"
            assert small["status"] == 200
            assert small["load_ms"] > 0


async def test_an_idle_model_is_unloaded_after_its_ttl(short_dir: Path) -> None:
    tables = [TABLES[0], {**TABLES[1], "ttl_s": 0.5}]
    with trio.fail_after(DEADLINE_S):
        async with serving(short_dir, tables=tables) as (running, client):
            await complete(client, "small", "The sky is")
            small = running.daemon.models.get("small")
            assert small is not None
            await small.wait_state(ModelState.UNLOADED)
            big = running.daemon.models.get("big")
            assert big is not None
            assert big.state is ModelState.LOADED  # no ttl_s: never


async def test_onebitctl_loads_and_unloads_a_model(short_dir: Path) -> None:
    onebitctl = Path(sys.executable).parent / "onebitctl"
    with trio.fail_after(DEADLINE_S):
        async with serving(short_dir) as (running, client):
            socket = str(running.daemon.admin.path)
            loaded = await trio.run_process(
                [str(onebitctl), "--socket", socket, "load", "small"], capture_stdout=True, env=dict(os.environ)
            )
            assert loaded.stdout.decode().startswith("small: loaded in ")
            assert states((await client.get("/v1/models")).json()) == {"big": "loaded", "small": "loaded"}
            status = await admin.call(running.daemon.admin.path, "status")
            models = {m["name"]: m for m in status["result"]["models"]["models"]}
            assert models["small"]["state"] == "loaded"
            assert models["small"]["memory_mib"] > 0
            unloaded = await trio.run_process(
                [str(onebitctl), "--socket", socket, "unload", "small"], capture_stdout=True
            )
            assert unloaded.stdout.decode() == "small: unloaded\n"
            refused = await admin.call(running.daemon.admin.path, "load", {"model": "nope"})
            assert refused["ok"] is False
            assert "big" in refused["error"]


async def test_one_ggml_provider_both_models_name_is_swapped_to_each_and_takes_the_file_route(
    short_dir: Path, route_lines: RouteLines
) -> None:
    real_llama_server()
    tables = [{**table, "providers": ["p0"]} for table in TABLES]
    config = make_config(
        short_dir,
        model=tables,
        decoder={"threads": 1},
        cache={"ram_mib": 0, "min_tokens": 64},
        hybrid={"enabled": True, "min_prompt_tokens": 16, **HANDOFF_ALWAYS},
        provider=[{"kind": "llama-server", "name": "p0", "threads": 1}],
    )
    with trio.fail_after(DEADLINE_S):
        async with (
            run_daemon(config) as running,
            httpx.AsyncClient(base_url=running.url, timeout=DEADLINE_S) as client,
        ):
            models = running.daemon.models

            def tenant(name: str) -> Tenant:
                model = models.get(name)
                assert model is not None
                (provider,) = model.parts.providers.all
                assert isinstance(provider, Tenant)
                return provider

            def ready(name: str) -> bool:
                return tenant(name).ready

            await wait_until(partial(ready, "big"))
            order = ["big", "small", "small", "big", "big"]
            for turn, name in enumerate(order):
                if turn in (2, 4):  # after each swap was asked for: its model's process up
                    await wait_until(partial(ready, name))
                await complete(client, name, f"{LONG} turn {turn}")
            lines = await route_lines.until(len(order))
            assert [(line["model"], line["route"], line.get("fallback")) for line in lines] == [
                ("big", "file", None),
                ("small", "plain", "provider-swapping"),
                ("small", "file", None),
                ("big", "plain", "provider-swapping"),
                ("big", "file", None),
            ]
            seat = tenant("big").seat
            assert seat.swaps == 2
            assert seat.start_ms is not None
            print(f"p0 started for {seat.holder} in {seat.start_ms:.0f} ms")
