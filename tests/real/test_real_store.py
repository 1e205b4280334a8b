"""The prefix store in onebitd's request path, against the real llama-server: prefixes kept after
replies, restored after a decoder crash and after an onebitd restart, dropped when the decoder's
parameters change, and dropped (the request still served) when the decoder refuses one.

llama-server runs with ``--cache-ram 0`` (``cache.ram_mib``): its own host-memory prompt cache must
not be what serves a prefix after a restart.  The reference reply is the same decoder answering from
its own prompt cache: a fresh daemon without a store, the first question, then the question asked.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from supervisor.config import Config
from supervisor.daemon import Daemon
from supervisor.prefix import files as prefix_files
from supervisor.prefix.store import PrefixStore
from supervisor.supervise.child import ChildState
from tests.rigs.helpers import wait_until
from tests.rigs.rig import RouteLines, make_config, real_llama_server, run_daemon

pytestmark = pytest.mark.real

DEADLINE_S = 420
SYSTEM = "You keep a list of words for the user. The list: " + ", ".join(f"word{i}" for i in range(40)) + "."
# Each question starts with its own word, so every prompt leaves the shared prefix at the same token.
QUESTIONS = ["Alpha: which word comes after word7?", "Bravo: which word comes after word12?"]
QUESTIONS += ["Charlie: which word comes after word21?", "Delta: which word comes after word30?"]


@pytest.fixture
def store_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ob-store-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def config(runtime: Path, store: Path, **model: Any) -> Config:
    real_llama_server()
    return make_config(
        runtime,
        model={"parallel": 2, "ctx_size": 2048, **model},
        decoder={"threads": 1},
        cache={"dir": str(store), "min_tokens": 64, "ram_mib": 0},
    )


def body(question: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"messages": messages, "max_tokens": 10, "temperature": 0}


async def ask(url: str, question: str) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        reply = await client.post("/v1/chat/completions", json=body(question))
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"]["content"])


async def stored(daemon: Daemon, n: int) -> None:
    """The store's writes run off the requests' path: wait for the n-th to commit."""
    await wait_until(lambda: daemon.models.default.store_statistics().stores >= n)


def opened(daemon: Daemon) -> PrefixStore:
    """The default model's prefix store, which this test's config turns on."""
    store = daemon.models.default.store
    assert store is not None
    return store


async def crash_decoder(daemon: Daemon) -> None:
    decoder = daemon.models.default.decoder
    pid, generation = decoder.pid, decoder.generation
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    while not (decoder.generation > generation and decoder.state is ChildState.READY):
        await decoder.wait_state(*(s for s in ChildState if s is not decoder.state))


def store_events(feed: trio.MemoryReceiveChannel[dict[str, Any]]) -> list[dict[str, Any]]:
    """The store's events the feed holds now, in order."""
    events: list[dict[str, Any]] = []
    while True:
        try:
            event = feed.receive_nowait()
        except trio.WouldBlock:
            return events
        if event["event"] == "store":
            events.append(event)


async def test_a_shared_prefix_survives_a_decoder_crash_and_an_onebitd_restart_and_replies_equal_the_cached_ones(
    short_dir: Path, store_dir: Path, route_lines: RouteLines, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="onebit.prefix")
    with trio.fail_after(DEADLINE_S):
        # The reference: the same flags, no store, the prefix in the decoder's own cache.
        reference_dir = Path(tempfile.mkdtemp(prefix="ob-", dir="/tmp"))
        try:
            async with run_daemon(config(reference_dir, reference_dir / "prefix")) as running:
                await ask(running.url, QUESTIONS[0])
                expected = [await ask(running.url, q) for q in QUESTIONS[2:]]
        finally:
            shutil.rmtree(reference_dir, ignore_errors=True)
        route_lines.lines.clear()

        async with run_daemon(config(short_dir, store_dir)) as running:
            daemon = running.daemon
            feed = daemon.route_stats.watch()  # the live feed's store events (the status page's)
            await ask(running.url, QUESTIONS[0])  # a new prompt: kept whole
            await ask(running.url, QUESTIONS[1])  # branches off the first: the shared prefix is kept
            await stored(daemon, 2)
            keys = {len(entry.tokens) for entry in opened(daemon).list()}
            await crash_decoder(daemon)
            after_crash = await ask(running.url, QUESTIONS[2])
            told = store_events(feed)
        async with run_daemon(config(short_dir, store_dir)) as running:
            # The two, and the prompt that went on from the restored prefix, kept whole.
            assert running.daemon.models.default.store_statistics().entries == 3
            after_restart = await ask(running.url, QUESTIONS[3])
    assert [after_crash, after_restart] == expected
    assert [e["what"] for e in told][:3] == ["stored", "stored", "restored"], told
    assert sorted(e["tokens"] for e in told[:2]) == sorted(keys)
    *_, crashed, restarted = route_lines.lines
    prefix = min(keys)
    for line in (crashed, restarted):
        assert line["restored_tokens"] == prefix, line
        assert line["cached_tokens"] >= prefix - 1
        assert line["decoder_prompt_n"] <= line["prompt_tokens"] - prefix + 1
    assert prefix < max(keys) < crashed["prompt_tokens"] + 16


async def test_an_entry_from_a_decoder_with_other_parameters_is_dropped_at_start(
    short_dir: Path, store_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="onebit.prefix")
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config(short_dir, store_dir)) as running:
            await ask(running.url, QUESTIONS[0])
            await stored(running.daemon, 1)
        async with run_daemon(config(short_dir, store_dir, ctx_size=4096)) as running:
            statistics = running.daemon.models.default.store_statistics()
            assert (statistics.entries, statistics.drops) == (0, 1)
            await ask(running.url, QUESTIONS[0])
    dropped = [r.getMessage() for r in caplog.records if r.name == "onebit.prefix" and "fingerprint" in r.getMessage()]
    assert len(dropped) == 1, dropped


async def test_an_entry_the_decoder_refuses_is_dropped_and_the_request_is_served(
    short_dir: Path, store_dir: Path, route_lines: RouteLines, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="onebit.prefix")
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config(short_dir, store_dir)) as running:
            expected = await ask(running.url, QUESTIONS[0])
            await stored(running.daemon, 1)
            [entry] = opened(running.daemon).list()
        # Damaged before it was committed: a state file version llama-server does not read, the
        # size, the magic and a content hash of the damaged bytes as a commit would have them, so
        # that the store hands it over and the decoder is the one to refuse it.
        state = store_dir / f"{entry.key}.state"
        data = bytearray(state.read_bytes())
        data[4:8] = (99).to_bytes(4, "little")
        state.write_bytes(bytes(data))
        sidecar = prefix_files.sidecar_path(store_dir, entry.key)
        document = json.loads(sidecar.read_bytes())
        sidecar.write_text(json.dumps({**document, "blake2b": prefix_files.digest(state)}))
        async with run_daemon(config(short_dir, store_dir)) as running:
            daemon = running.daemon
            got = await ask(running.url, QUESTIONS[0])  # a new decoder: its slot holds nothing
            assert daemon.models.default.store_statistics().entries == 0
    assert got == expected
    line = route_lines.lines[-1]
    assert (line["outcome"], line["restored_tokens"]) == ("ok", None)
    assert line["decoder_prompt_n"] == line["prompt_tokens"]  # prefilled as if there were no store
    assert any("refused" in r.getMessage() or "answered" in r.getMessage() for r in caplog.records)
    assert list((short_dir / "state").iterdir()) == []
