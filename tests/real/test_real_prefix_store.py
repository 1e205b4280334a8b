"""The prefix store with the real llama-server and SmolLM2: a prefix saved by one decoder process,
stored, the store reopened and the decoder restarted (as after a crash or an upgrade), then restored
into another slot through the store's exposed name; the decoder prefills only the rest.

The reference reply is the one the same decoder gives when it holds the prefix in its own prompt
cache (llama.cpp's greedy output can depend on how a prompt was split into batches, so a cold prefill
of the whole prompt is not the reference).  llama-server runs with ``--cache-ram 0``: its in-memory
prompt cache must not be what serves the prefix.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from supervisor.config import Config
from supervisor.llama.decoder import DecoderClient
from supervisor.llama.llama_server import LlamaServerLauncher, StateFingerprint, server_version
from supervisor.supervise.process import ChildProcess
from tests.rigs.rig import make_config, real_llama_server
from tests.unit.prefix.test_prefix_store import private_store

pytestmark = pytest.mark.real

# Two slots of 1024 tokens; one thread each, on a 2-core machine shared with other suites.
MODEL = {"parallel": 2, "ctx_size": 2048}
DEADLINE_S = 240
# About 350 tokens of SmolLM2's vocabulary: a prefix worth storing, well inside one slot.
PREFIX_TEXT = "Here is a list of words to remember. " + " ".join(f"word{i}" for i in range(100))
SUFFIX_TEXT = "\nQuestion: which word comes right after word41? Answer:"
GREEDY = {"n_predict": 16, "temperature": 0, "seed": 1, "cache_prompt": True}


@pytest.fixture
def state_dir(short_dir: Path) -> Iterator[Path]:
    """llama-server's --slot-save-path: on a tmpfs when there is one, as under systemd (the store is
    then on another file system, and put_file copies); else beside the store."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shm.stat().st_dev != short_dir.stat().st_dev:
        path = Path(tempfile.mkdtemp(prefix="ob-state-", dir=shm))
    else:
        path = short_dir / "state"
        path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@attrs.frozen
class Decoder:
    client: DecoderClient
    process: ChildProcess

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        status, data = await self.client.post_json(path, body)
        assert status == 200, data
        assert isinstance(data, dict)
        return data

    async def tokens(self, text: str) -> list[int]:
        data = await self.post("/tokenize", {"content": text, "add_special": False})
        return [int(t) for t in data["tokens"]]


@asynccontextmanager
async def real_decoder(config: Config, socket: Path, state_dir: Path) -> AsyncIterator[Decoder]:
    """One llama-server, started as onebitd starts its decoder; stopped and reaped on the way out."""
    launcher = LlamaServerLauncher(
        "decoder", config, binary="", client=DecoderClient(socket), slot_save_path=state_dir, threads=1, extra_args=()
    )
    launcher.prepare()
    process = await ChildProcess.spawn("decoder", launcher.argv())
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(process.pump_output)
            # Another process loading its model: nothing to wait on but its /health.
            while not await launcher.healthy():
                assert process.returncode is None
                await trio.sleep(0.05)
            try:
                yield Decoder(launcher.client, process)
            finally:
                nursery.cancel_scope.cancel()
    finally:
        await process.stop(grace=5)
        await launcher.client.aclose()


def fingerprint(config: Config, version: str) -> StateFingerprint:
    return StateFingerprint.of(config, version)


async def test_a_stored_prefix_restored_into_another_slot_after_a_restart_gives_the_warm_reply(
    short_dir: Path, state_dir: Path
) -> None:
    binary = real_llama_server()
    config = make_config(short_dir, model=MODEL, cache={"ram_mib": 0})
    store_dir = short_dir / "store"
    socket = short_dir / "d.sock"
    with trio.fail_after(DEADLINE_S):
        version = await server_version(binary)
        assert version.startswith("version: ")
        store_options: dict[str, Any] = {
            "fingerprint": fingerprint(config, version),
            "max_bytes": 1024**3,
            "min_tokens": 64,
        }

        # 1. The first decoder prefills the prefix and saves its slot; the store takes the file.
        async with real_decoder(config, socket, state_dir) as first:
            prefix = await first.tokens(PREFIX_TEXT)
            suffix = await first.tokens(SUFFIX_TEXT)
            assert len(prefix) >= 256
            await first.post("/completion", {"prompt": prefix, "n_predict": 0, "id_slot": 0, "cache_prompt": True})
            saved = await first.post("/slots/0?action=save", {"filename": "saved.state"})
            assert saved["n_saved"] == len(prefix)
            store = await private_store(store_dir, **store_options)
            assert await store.put_file(prefix, state_dir / "saved.state")
            store.close()
        assert os.listdir(state_dir) == []

        # 2. onebitd and the decoder restarted: the store is opened again, a new decoder started.
        store = await private_store(store_dir, **store_options)
        prompt = [*prefix, *suffix]
        entry = store.lookup(prompt)
        assert entry is not None
        assert entry.tokens == tuple(prefix)
        async with real_decoder(config, socket, state_dir) as second:
            # The reference: slot 0 holds the prefix in its own cache, then gets the whole prompt.
            await second.post("/completion", {"prompt": prefix, "n_predict": 0, "id_slot": 0, "cache_prompt": True})
            warm = await second.post("/completion", {"prompt": prompt, "id_slot": 0, **GREEDY})
            assert warm["timings"]["cache_n"] == len(prefix)

            # 3. The entry restored into slot 1 through the name the store exposes.
            async with store.exposed(entry, state_dir) as name:
                assert (state_dir / name).is_symlink()
                restored = await second.post("/slots/1?action=restore", {"filename": name})
            store.record_restore(float(restored["timings"]["restore_ms"]))
            assert restored["n_restored"] == len(prefix)
            assert os.listdir(state_dir) == []
            reply = await second.post("/completion", {"prompt": prompt, "id_slot": 1, **GREEDY})

    assert reply["content"] == warm["content"]
    assert reply["content"].strip()
    assert len(suffix) <= reply["timings"]["prompt_n"] <= len(suffix) + 1
    assert reply["timings"]["cache_n"] >= len(prefix) - 1
    stats = store.statistics()
    assert (stats.entries, stats.hits, stats.restores) == (1, 1, 1)
    assert stats.restore_ms_last is not None
    assert stats.bytes == sum(path.stat().st_size for path in store_dir.glob("*.*") if path.name != ".lock")
    store.close()

    # 4. A decoder started with another -c cannot use it: the entry is dropped at open.
    other = make_config(short_dir, model={**MODEL, "ctx_size": 4096}, cache={"ram_mib": 0})
    reopened = await private_store(store_dir, **{**store_options, "fingerprint": fingerprint(other, version)})
    assert reopened.list() == []
    assert sorted(path.name for path in store_dir.iterdir()) == [".lock"]
    reopened.close()
