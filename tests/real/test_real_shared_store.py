"""A prefix store two onebitd share (cache.shared_dir), against the real llama-server: host A serves two
conversations that share a system prompt and is drained (its slot handed over to the store); host B,
running all along, gets a conversation's next turn at once and restores it from A's entry, and a
dead writer's half-written files in the directory are never restored.

Both daemons run in this trio run on one machine, each with its own real llama-server, runtime
directory, private store and ``server.host_id``; only the shared directory is common.  A writer
SIGKILLed mid-write is made by hand (its files as write_entry names them, one a truncated copy of a
real state file): killing at an exact step is not deterministic.
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

from supervisor.admin import verbs
from supervisor.config import Config
from supervisor.prefix import files as prefix_files
from supervisor.prefix import shared
from tests.real.test_real_store import SYSTEM
from tests.rigs.helpers import wait_until
from tests.rigs.rig import RouteLines, make_config, real_llama_server, run_daemon

pytestmark = pytest.mark.real

DEADLINE_S = 420
FIRST = "Alpha: which word comes after word7?"
SECOND = "Bravo: which word comes after word12?"
THIRD = "Charlie: and which word comes after that one?"


@pytest.fixture
def dirs() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ob-sh-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def config(root: Path, host: str, rescan_s: float = 0.2) -> Config:
    real_llama_server()
    return make_config(
        root / host,
        server={"host_id": host},
        model={"parallel": 2, "ctx_size": 2048},
        decoder={"threads": 1},
        cache={
            "dir": str(root / host / "prefix"),
            "shared_dir": str(root / "shared"),
            "shared_rescan_s": rescan_s,
            "min_tokens": 64,
            "ram_mib": 0,  # llama-server's own prompt cache must not be what serves a prefix
        },
    )


async def chat(url: str, messages: list[dict[str, str]]) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        reply = await client.post(
            "/v1/chat/completions", json={"messages": messages, "max_tokens": 10, "temperature": 0}
        )
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"]["content"])


def committed(directory: Path) -> dict[str, dict[str, Any]]:
    return {
        path.name[: -len(prefix_files.SIDECAR)]: json.loads(path.read_bytes())
        for path in directory.glob(f"*{prefix_files.SIDECAR}")
    }


def plant_a_dead_writers_files(directory: Path, like: str) -> list[Path]:
    """What a host SIGKILLed mid-write leaves: its temporary state file half written, and a state
    file renamed in whose sidecar never was, both copies of the real entry ``like``."""
    state = prefix_files.state_path(directory, like).read_bytes()
    name = f"{like.split(shared.SEPARATOR)[0]}{shared.SEPARATOR}dead-host{shared.SEPARATOR}0badf00d"
    half = directory / f"{prefix_files.TEMP_PREFIX}{name}-1234abcd{prefix_files.STATE}"
    half.write_bytes(state[: len(state) // 2])
    orphan = prefix_files.state_path(directory, name)
    orphan.write_bytes(state)
    return [half, orphan]


async def test_a_drained_hosts_conversation_goes_on_at_another_host_from_its_shared_entry(
    dirs: Path, route_lines: RouteLines, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="onebit.prefix")
    shared_dir = dirs / "shared"
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}]
    second = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": SECOND}]
    with trio.fail_after(DEADLINE_S):
        # B's own rescans are a minute apart: only a request's look at the directory finds A's entry.
        async with run_daemon(config(dirs, "host-a")) as a, run_daemon(config(dirs, "host-b", 60.0)) as b:
            store_a = a.daemon.models.default.store
            store_b = b.daemon.models.default.store
            assert store_a is not None
            assert store_b is not None
            assert store_a.shared
            await chat(a.url, first)  # a new prompt: stored whole after its reply
            reply = await chat(a.url, second)  # branches off the first: only the system prompt is stored
            await wait_until(lambda: store_a.statistics().stores >= 2)
            before = set(committed(shared_dir))
            # The drain: nothing in flight, then the slot holding the second conversation is saved.
            events: list[dict[str, Any]] = []

            async def send(event: dict[str, Any]) -> None:
                events.append(event)

            drained = await verbs.verb_drain(a.daemon, {}, send)
            assert drained == {"drained": True, "kept": 1}
            handed = {name: doc for name, doc in committed(shared_dir).items() if name not in before}
            [(handed_name, handed_doc)] = handed.items()
            assert handed_doc["host"] == "host-a"
            dead = plant_a_dead_writers_files(shared_dir, handed_name)

            # The balancer sends the conversation's next turn to B at once.
            next_turn = [*second, {"role": "assistant", "content": reply}, {"role": "user", "content": THIRD}]
            route_lines.lines.clear()
            assert store_b.statistics().entries == 0
            await chat(b.url, next_turn)
            stats = store_b.statistics()
            assert {entry.origin_host for entry in store_b.list()} >= {"host-a"}
            assert not any(entry.origin_host == "dead-host" for entry in store_b.list())
    [line] = route_lines.lines
    assert line["origin_host"] == "host-a"
    assert line["restored_tokens"] == len(handed_doc["tokens"])
    assert line["restored_tokens"] > 0
    # Only the turn's new tokens are prefilled (a prompt that ends where the entry does: at most 2).
    assert line["decoder_prompt_n"] <= line["prompt_tokens"] - line["restored_tokens"] + 2
    assert (stats.restores, stats.restores_other) == (1, 1)
    assert all(path.exists() for path in dead)  # young: maybe a live host's write; never read
    said = [r.getMessage() for r in caplog.records if r.name == "onebit.prefix"]
    assert any(m.startswith(f"prefix store: shared: {shared_dir} as host host-b: 0 entries") for m in said)
