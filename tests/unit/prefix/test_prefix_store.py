"""The prefix store without llama-server: lookup, de-duplication, LRU within max_bytes, pins, torn
files, fingerprints, a full disk, a directory it cannot use, and readers racing a writer.

State files here are made up (llama.cpp's magic, then filler bytes): the store checks only the
magic and its content hash.  tests/real/test_real_prefix_store.py does the same with state files the
real llama-server saved.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import subprocess
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from supervisor import config as configuration
from supervisor.config import locate
from supervisor.errors import PrefixStoreError
from supervisor.llama.decoder import DecoderClient
from supervisor.llama.llama_server import LlamaServerLauncher, StateFingerprint
from supervisor.llama.statefile import MAGIC_BYTES as STATE_MAGIC
from supervisor.prefix import files as prefix_files
from supervisor.prefix import index as prefix_index
from supervisor.prefix.background import NICE, Background
from supervisor.prefix.files import Disk
from supervisor.prefix.index import BLOCK, PrefixIndex, token_key
from supervisor.prefix.opening import open_prefix_store, open_private
from supervisor.prefix.store import MAX_PENDING_PUTS, PrefixStore
from tests.rigs.rig import make_config

FINGERPRINT = StateFingerprint(
    model_path="/models/m.gguf",
    model_size=1000,
    model_mtime_ns=1,
    model_head_sha256="ab" * 32,
    server_version="version: 1 (test)",
    ctx_size=4096,
    parallel=4,
    batch_size=2048,
    ubatch_size=512,
    cache_type_k="f16",
    cache_type_v="f16",
    extra_args=(),
)
MIN_TOKENS = 8
KIB = 1024


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


async def private_store(directory: Path, **options: Any) -> PrefixStore:
    """A private store in ``directory`` (supervisor/prefix/opening.py's ``open_private``), which must open."""
    store = await open_private(directory, **options)
    assert store is not None, f"the prefix store in {directory} is off"
    return store


@attrs.define
class Rig:
    store_dir: Path
    state_dir: Path
    made: int = 0

    def state_file(self, size: int = 10 * KIB) -> Path:
        """A file shaped like a llama.cpp slot state file, in the state directory."""
        self.made += 1
        path = self.state_dir / f"saved-{self.made}.state"
        path.write_bytes(STATE_MAGIC + b"\0" * (size - len(STATE_MAGIC)))
        return path

    async def open(self, max_bytes: int = 1024 * KIB, **kwargs: Any) -> PrefixStore:
        return await private_store(self.store_dir, **{**self.options(max_bytes), **kwargs})

    async def try_open(self, max_bytes: int = 1024 * KIB, **kwargs: Any) -> PrefixStore | None:
        """None: the store is off (said in one line)."""
        return await open_private(self.store_dir, **{**self.options(max_bytes), **kwargs})

    def options(self, max_bytes: int) -> dict[str, Any]:
        return {"fingerprint": FINGERPRINT, "max_bytes": max_bytes, "min_tokens": MIN_TOKENS}

    def files(self) -> list[str]:
        return sorted(path.name for path in self.store_dir.iterdir() if path.name != ".lock")

    def disk_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.store_dir.iterdir() if path.name != ".lock")


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    (tmp_path / "state").mkdir()
    return Rig(tmp_path / "store", tmp_path / "state")


@pytest.fixture
def prefix_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="onebit.prefix")
    return caplog


def messages(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "onebit.prefix" and r.levelno >= level]


# -- the index: pure --------------------------------------------------------------------------------


def brute_force(stored: Mapping[str, Sequence[int]], prompt: Sequence[int]) -> int:
    """The length of the longest stored sequence that ``prompt`` starts with (-1: none)."""
    lengths = [len(t) for t in stored.values() if list(prompt[: len(t)]) == list(t)]
    return max(lengths, default=-1)


def test_the_longest_stored_prefix_of_a_prompt_is_found_across_block_boundaries() -> None:
    index = PrefixIndex()
    base = tokens(5 * BLOCK + 7)
    for n in (BLOCK - 1, BLOCK, 2 * BLOCK + 3, 5 * BLOCK + 7):
        index.add(f"k{n}", base[:n])
    index.add("other", tokens(3 * BLOCK, start=10_000))
    assert index.longest_prefix([*base, 1, 2, 3]) == f"k{5 * BLOCK + 7}"
    assert index.longest_prefix(base[: 5 * BLOCK + 6]) == f"k{2 * BLOCK + 3}"
    assert index.longest_prefix(base[: 2 * BLOCK + 3]) == f"k{2 * BLOCK + 3}"  # the whole prompt counts
    assert index.longest_prefix(base[: 2 * BLOCK + 2]) == f"k{BLOCK}"
    assert index.longest_prefix(base[: BLOCK - 2]) is None
    assert index.longest_prefix(tokens(4 * BLOCK, start=10_000)) == "other"


def test_an_entry_that_differs_from_the_prompt_in_one_token_is_not_its_prefix() -> None:
    index = PrefixIndex()
    stored = tokens(3 * BLOCK + 10)
    index.add("k", stored)
    for position in (0, BLOCK + 5, 3 * BLOCK + 9):  # inside a hashed block, and in the tail past it
        prompt = [*stored, 99]
        prompt[position] = -5
        assert index.longest_prefix(prompt) is None
    assert index.longest_prefix([*stored, 99]) == "k"


def test_a_removed_entry_is_never_found_again_and_the_others_still_are() -> None:
    index = PrefixIndex()
    index.add("short", tokens(BLOCK + 1))
    index.add("long", tokens(BLOCK + 9))
    index.remove("long")
    index.remove("missing")
    assert index.longest_prefix(tokens(2 * BLOCK)) == "short"
    assert len(index) == 1
    index.remove("short")
    assert index.longest_prefix(tokens(2 * BLOCK)) is None


def test_a_prompt_shorter_than_every_entry_or_an_empty_index_finds_nothing() -> None:
    index = PrefixIndex()
    assert index.longest_prefix(tokens(BLOCK)) is None
    index.add("k", tokens(BLOCK + 3))
    assert index.longest_prefix(tokens(BLOCK + 2)) is None
    assert index.longest_prefix([]) is None


def test_a_hash_collision_costs_time_never_a_wrong_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every prefix gets the same hash: every entry shares one anchor, and only the token by token
    # check tells them apart.
    monkeypatch.setattr(prefix_index, "_anchors", lambda _tokens, n_blocks: [7] * (n_blocks + 1))
    index = PrefixIndex()
    index.add("a", tokens(2 * BLOCK, start=1))
    index.add("b", tokens(2 * BLOCK + 5, start=7))
    assert index.longest_prefix(tokens(3 * BLOCK, start=1)) == "a"
    assert index.longest_prefix(tokens(3 * BLOCK, start=3)) is None


@given(
    stored=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=14), max_size=8),
    prompt=st.lists(st.integers(0, 3), max_size=16),
)
def test_the_index_agrees_with_a_brute_force_search(stored: list[list[int]], prompt: list[int]) -> None:
    # Blocks of 4 tokens, so that short sequences cross many block boundaries.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefix_index, "BLOCK", 4)
        index = PrefixIndex()
        by_key = {}
        for sequence in stored:
            key = token_key(sequence)
            index.add(key, sequence)
            by_key[key] = sequence
        found = index.longest_prefix(prompt)
    expected = brute_force(by_key, prompt)
    assert (len(by_key[found]) if found is not None else -1) == expected


def test_a_4k_token_lookup_among_hundreds_of_entries_behind_one_system_prompt_verifies_one_candidate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its cost does not grow with the number of entries: at most 64 hashes, a dict read per
    anchor, and the exact check of the answer (about 0.1 ms on this machine; no wall-clock bound
    here: the counts are what cannot regress)."""
    index = PrefixIndex()
    system = tokens(1500)
    for i in range(300):  # one system prompt, 300 questions
        index.add(f"q{i}", [*system, *tokens(20 + i % 40, start=100_000 + 100 * i)])
    for i in range(300):  # and entries that share nothing with the prompt
        index.add(f"o{i}", tokens(3000, start=200_000 + i))
    checked: list[str] = []
    hashed: list[int] = []
    real_verified, real_anchors = prefix_index._verified, prefix_index._anchors

    def verified(prompt: tuple[int, ...], stored: tuple[int, ...]) -> bool:
        checked.append(str(len(stored)))
        return real_verified(prompt, stored)

    def anchors(whole: tuple[int, ...], n_blocks: int) -> list[int]:
        hashed.append(n_blocks)
        return real_anchors(whole, n_blocks)

    monkeypatch.setattr(prefix_index, "_verified", verified)
    monkeypatch.setattr(prefix_index, "_anchors", anchors)
    new_question = [*system, *tokens(2596, start=900_000)]
    assert index.longest_prefix(new_question) is None
    assert checked == []
    assert hashed == [3000 // BLOCK]
    asked_before = [*system, *tokens(20 + 7 % 40, start=100_000 + 700), *tokens(2000, start=5)]
    assert index.longest_prefix(asked_before) == "q7"
    assert len(checked) == 1


# -- putting, finding, de-duplicating ---------------------------------------------------------------


async def test_a_stored_prefix_is_found_by_a_longer_prompt_and_survives_a_reopen(rig: Rig) -> None:
    prefix = tokens(300)
    store = await rig.open()
    assert await store.put_file(prefix, rig.state_file(20 * KIB))
    entry = store.lookup([*prefix, 7, 8, 9])
    assert entry is not None
    assert entry.tokens == tuple(prefix)
    assert entry.state_bytes == 20 * KIB
    assert list(rig.state_dir.iterdir()) == []  # the state file moved into the store
    store.close()
    again = await rig.open()
    found = again.lookup([*prefix, 1])
    assert found is not None
    assert found.key == entry.key
    assert found.disk_bytes == entry.disk_bytes
    assert again.statistics().bytes == rig.disk_bytes() == entry.disk_bytes
    again.close()


def modes(directory: Path) -> dict[str, int]:
    return {path.name: stat.S_IMODE(path.stat().st_mode) for path in [directory, *directory.iterdir()]}


@pytest.mark.parametrize("umask", [0o022, 0o000])
async def test_the_store_is_private_whatever_the_umask(rig: Rig, umask: int) -> None:
    # A sidecar holds a prompt's token ids: no other local user may read it, nor list the directory.
    old = os.umask(umask)
    try:
        store = await rig.open()
        source = rig.state_file()
        source.chmod(0o644)  # as llama-server saves it
        assert await store.put_file(tokens(100), source)
        store.close()
    finally:
        os.umask(old)
    found = modes(rig.store_dir)
    assert found.pop("store") == 0o700
    assert found.pop(".lock") == 0o600
    assert set(found.values()) == {0o600}
    assert len(found) == 2  # the state file and its sidecar


async def test_entries_an_older_onebitd_left_readable_are_made_private_at_open(rig: Rig) -> None:
    store = await rig.open()
    assert await store.put_file(tokens(100), rig.state_file())
    store.close()
    rig.store_dir.chmod(0o755)
    for path in rig.store_dir.iterdir():
        path.chmod(0o644)
    again = await rig.open()
    assert again.lookup(tokens(100)) is not None
    again.close()
    found = modes(rig.store_dir)
    assert found.pop("store") == 0o700
    found.pop(".lock")
    assert set(found.values()) == {0o600}


async def test_two_puts_of_the_same_tokens_make_one_entry_and_consume_both_files(rig: Rig) -> None:
    store = await rig.open()
    first, second = rig.state_file(), rig.state_file()
    assert store.wants(tokens(100))
    assert await store.put_file(tokens(100), first)
    assert not store.wants(tokens(100))
    assert store.wants(tokens(101))
    assert await store.put_file(tokens(100), second)
    assert not first.exists()
    assert not second.exists()
    assert len(rig.files()) == 2  # one state file, one sidecar
    stats = store.statistics()
    assert (stats.entries, stats.stores, stats.duplicates) == (1, 1, 1)
    store.close()


async def test_concurrent_puts_of_the_same_tokens_make_one_entry(rig: Rig) -> None:
    store = await rig.open()
    results: list[bool] = []

    async def put() -> None:
        results.append(await store.put_file(tokens(100), rig.state_file()))

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(put)
    assert results == [True] * 4
    assert store.statistics().entries == 1
    assert len(rig.files()) == 2
    assert list(rig.state_dir.iterdir()) == []
    store.close()


async def test_a_prefix_shorter_than_min_tokens_is_not_stored(rig: Rig) -> None:
    store = await rig.open()
    assert not store.wants(tokens(MIN_TOKENS - 1))
    source = rig.state_file()
    assert not await store.put_file(tokens(MIN_TOKENS - 1), source)
    assert not source.exists()
    assert rig.files() == []
    assert store.statistics().skipped == 1
    store.close()


async def test_tokens_that_are_not_llama_tokens_are_refused_without_raising(rig: Rig) -> None:
    store = await rig.open()
    assert not store.wants([2**40, *tokens(20)])
    assert not await store.put_file([2**40, *tokens(20)], rig.state_file())
    assert rig.files() == []
    store.close()


async def test_a_file_that_is_not_a_llama_state_file_is_refused(rig: Rig) -> None:
    store = await rig.open()
    source = rig.state_dir / "junk.state"
    source.write_bytes(b"not a state file at all")
    assert not await store.put_file(tokens(100), source)
    assert rig.files() == []
    assert not source.exists()
    assert store.statistics().store_failures == 1
    store.close()


# -- max_bytes and the LRU order --------------------------------------------------------------------


async def test_the_least_recently_used_entry_is_evicted_first(rig: Rig) -> None:
    store = await rig.open(max_bytes=30 * KIB)  # room for two
    a, b, c = tokens(100, 0), tokens(100, 1000), tokens(100, 2000)
    assert await store.put_file(a, rig.state_file())
    assert await store.put_file(b, rig.state_file())
    entry_a = store.lookup(a)
    assert entry_a is not None
    async with store.exposed(entry_a, rig.state_dir):  # a use: b is now the oldest
        pass
    assert await store.put_file(c, rig.state_file())
    assert store.lookup(b) is None
    assert store.lookup(a) is not None
    assert store.lookup(c) is not None
    assert store.statistics().evictions == 1
    assert [e.tokens[0] for e in store.list()] == [2000, 0]  # most recently used first
    store.close()


async def test_the_store_never_holds_more_than_max_bytes_on_disk(rig: Rig) -> None:
    max_bytes = 100 * KIB
    store = await rig.open(max_bytes=max_bytes)
    for i in range(30):
        assert await store.put_file(tokens(50 + i, start=i * 1000), rig.state_file((7 + i % 11) * KIB))
        assert rig.disk_bytes() <= max_bytes
        assert store.statistics().bytes == rig.disk_bytes()
    assert store.statistics().evictions > 0
    store.close()


async def test_an_entry_larger_than_max_bytes_is_not_stored_and_evicts_nothing(rig: Rig) -> None:
    store = await rig.open(max_bytes=30 * KIB)
    assert await store.put_file(tokens(100), rig.state_file(10 * KIB))
    source = rig.state_file(40 * KIB)
    assert not await store.put_file(tokens(100, 500), source)
    assert not source.exists()
    assert store.statistics().entries == 1
    assert store.statistics().evictions == 0
    store.close()


async def test_a_lowered_max_bytes_evicts_the_oldest_entries_at_open(rig: Rig) -> None:
    store = await rig.open()
    for i in range(4):
        assert await store.put_file(tokens(100, i * 1000), rig.state_file())
        async with store.exposed(store.list()[0], rig.state_dir):
            pass  # distinct last-use times, oldest first
    store.close()
    smaller = await rig.open(max_bytes=25 * KIB)
    assert [e.tokens[0] for e in smaller.list()] == [3000, 2000]
    assert smaller.statistics().evictions == 2
    assert rig.disk_bytes() <= 25 * KIB
    smaller.close()


# -- pins: exposing an entry for a restore ----------------------------------------------------------


async def test_an_exposed_entry_is_a_plain_name_in_the_directory_removed_on_the_way_out(rig: Rig) -> None:
    store = await rig.open()
    assert await store.put_file(tokens(100), rig.state_file(12 * KIB))
    entry = store.lookup(tokens(120))
    assert entry is not None

    async def restore_that_fails() -> None:
        async with store.exposed(entry, rig.state_dir) as name:
            assert "/" not in name
            exposed = rig.state_dir / name
            assert exposed.read_bytes()[:4] == STATE_MAGIC
            assert exposed.stat().st_size == 12 * KIB
            assert store.statistics().pinned == 1
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await restore_that_fails()
    assert list(rig.state_dir.iterdir()) == []
    assert store.statistics().pinned == 0
    assert store.lookup(tokens(120)) is not None
    store.close()


async def test_a_pinned_entry_is_not_evicted_and_the_put_that_needs_its_room_is_skipped(rig: Rig) -> None:
    store = await rig.open(max_bytes=25 * KIB)
    assert await store.put_file(tokens(100), rig.state_file())
    entry = store.lookup(tokens(100))
    assert entry is not None
    async with store.exposed(entry, rig.state_dir):
        assert not await store.put_file(tokens(100, 500), rig.state_file(20 * KIB))
        assert store.lookup(tokens(100)) is not None
    assert await store.put_file(tokens(100, 500), rig.state_file(20 * KIB))
    assert store.lookup(tokens(100)) is None
    store.close()


async def test_an_entry_dropped_while_pinned_is_gone_for_lookups_at_once_and_on_disk_at_release(
    rig: Rig, prefix_log: pytest.LogCaptureFixture
) -> None:
    store = await rig.open()
    assert await store.put_file(tokens(100), rig.state_file())
    entry = store.lookup(tokens(100))
    assert entry is not None
    async with store.exposed(entry, rig.state_dir) as name:
        store.drop(entry, "cache_n 0: the decoder did not use it")
        store.drop(entry)  # already gone: ignored
        assert store.lookup(tokens(100)) is None
        assert (rig.state_dir / name).read_bytes()[:4] == STATE_MAGIC  # still readable by the decoder
        assert len(rig.files()) == 2
        assert store.statistics().bytes == entry.disk_bytes
        with pytest.raises(PrefixStoreError, match="gone"):
            async with store.exposed(entry, rig.state_dir):
                pass
    assert rig.files() == []
    assert store.statistics().bytes == 0
    assert store.statistics().drops == 1
    assert messages(prefix_log) == [
        f"prefix store: {rig.store_dir}: 0 entries, 0 bytes of {1024 * KIB}",
        f"prefix store: dropping entry {entry.key} (100 tokens): cache_n 0: the decoder did not use it",
    ]
    store.close()


async def test_exposing_into_a_directory_that_is_gone_raises_and_leaves_nothing_pinned(rig: Rig) -> None:
    store = await rig.open()
    assert await store.put_file(tokens(100), rig.state_file())
    entry = store.lookup(tokens(100))
    assert entry is not None
    with pytest.raises(PrefixStoreError, match="cannot expose"):
        async with store.exposed(entry, rig.state_dir / "missing"):
            pass
    assert store.statistics().pinned == 0
    store.drop(entry)
    assert rig.files() == []
    store.close()


# -- at open: torn, corrupt, foreign ----------------------------------------------------------------


async def test_torn_corrupt_and_stray_files_are_dropped_at_open_one_log_line_each(
    rig: Rig, prefix_log: pytest.LogCaptureFixture
) -> None:
    store = await rig.open()
    keep, *broken = [tokens(100, i * 1000) for i in range(6)]
    for sequence in [keep, *broken]:
        assert await store.put_file(sequence, rig.state_file())
    store.close()
    keys = [token_key(sequence) for sequence in broken]
    d = rig.store_dir
    (d / f"{keys[0]}.state").unlink()  # a sidecar without its state file
    os.truncate(d / f"{keys[1]}.state", 5000)  # a truncated state file
    (d / f"{keys[2]}.json").write_text("{not json")  # a corrupt sidecar
    (d / f"{keys[3]}.state").write_bytes(b"XXXX" + b"\0" * (10 * KIB - 4))  # not a state file any more
    (d / f"{keys[4]}.json").unlink()  # a state file whose sidecar was never committed
    (d / f".tmp-{keys[0]}-0123abcd.state").write_bytes(b"half")  # a write that never finished
    (d / "README").write_text("not ours")
    prefix_log.clear()
    again = await rig.open()
    lines = messages(prefix_log)
    assert len(lines) == 7, lines
    assert f"prefix store: dropping entry {keys[0]}: torn: no state file" in lines
    assert f"prefix store: dropping entry {keys[1]}: torn: state file has 5000 bytes, sidecar says {10 * KIB}" in lines
    assert any(line.startswith(f"prefix store: dropping entry {keys[2]}: unreadable sidecar") for line in lines)
    assert f"prefix store: dropping entry {keys[3]}: corrupt: not a llama.cpp state file" in lines
    assert any(line.startswith(f"prefix store: removing {keys[4]}.state: a state file without") for line in lines)
    assert f"prefix store: removing .tmp-{keys[0]}-0123abcd.state: a write that never finished" in lines
    assert [e.tokens for e in again.list()] == [tuple(keep)]
    assert rig.files() == sorted(["README", f"{token_key(keep)}.json", f"{token_key(keep)}.state"])
    assert again.statistics().drops == 6
    again.close()


async def test_a_sidecar_whose_tokens_do_not_match_its_name_is_dropped(rig: Rig) -> None:
    store = await rig.open()
    assert await store.put_file(tokens(100), rig.state_file())
    store.close()
    (sidecar,) = rig.store_dir.glob("*.json")
    document = json.loads(sidecar.read_text())
    document["tokens"][5] = 77
    sidecar.write_text(json.dumps(document))
    again = await rig.open()
    assert again.list() == []
    assert rig.files() == []
    again.close()


async def test_an_entry_made_under_another_fingerprint_is_dropped_at_open(
    rig: Rig, prefix_log: pytest.LogCaptureFixture
) -> None:
    store = await rig.open()
    assert await store.put_file(tokens(100), rig.state_file())
    store.close()
    again = await rig.open(fingerprint=attrs.evolve(FINGERPRINT, ctx_size=8192))
    assert again.list() == []
    assert rig.files() == []
    assert any("fingerprint differs" in line for line in messages(prefix_log))
    again.close()


def test_the_fingerprint_changes_with_the_model_file_the_server_and_every_kv_setting(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\1" * 100)
    config = make_config(tmp_path, model={"path": str(model)})
    base = StateFingerprint.of(config, "version: 1")
    assert StateFingerprint.of(config, "version: 1") == base
    assert StateFingerprint.of(config, "version: 2") != base
    for changed in ({"ctx_size": 2048}, {"parallel": 2}, {"ubatch_size": 256}, {"cache_type_k": "q8_0"}):
        assert StateFingerprint.of(make_config(tmp_path, model={"path": str(model), **changed}), "version: 1") != base
    extra = make_config(tmp_path, model={"path": str(model)}, decoder={"extra_args": ["-fa", "on"]})
    assert StateFingerprint.of(extra, "version: 1") != base
    os.utime(model, ns=(1, 1))
    assert StateFingerprint.of(config, "version: 1") != base


# -- faults: a full disk, a directory it cannot use -------------------------------------------------


class FullDisk(Disk):
    """Writes part of a file, then fails as a full file system does (on write, or on fsync)."""

    def __init__(self, *, where: str) -> None:
        self.where = where
        self.full = True

    def move_in(self, source: Path, target: Path) -> None:
        if self.full and self.where == "state":
            target.write_bytes(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        super().move_in(source, target)

    def write(self, target: Path, data: bytes) -> None:
        if self.full and self.where == "sidecar":
            target.write_bytes(data[:10])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        super().write(target, data)


@pytest.mark.parametrize("where", ["state", "sidecar"])
async def test_a_full_disk_drops_the_entry_removes_its_files_and_is_logged_once_per_burst(
    rig: Rig, prefix_log: pytest.LogCaptureFixture, where: str
) -> None:
    disk = FullDisk(where=where)
    disk.full = False
    store = await rig.open(disk=disk)
    disk.full = True
    prefix_log.clear()
    for i in range(3):
        source = rig.state_file()
        assert not await store.put_file(tokens(100, i * 1000), source)
        assert not source.exists()
    assert rig.files() == []
    assert store.lookup(tokens(100)) is None
    stats = store.statistics()
    assert (stats.entries, stats.bytes, stats.store_failures) == (0, 0, 3)
    warnings = messages(prefix_log, logging.WARNING)
    assert len(warnings) == 1
    assert "No space left on device" in warnings[0]
    disk.full = False
    assert await store.put_file(tokens(100, 9000), rig.state_file())
    disk.full = True
    assert not await store.put_file(tokens(100, 8000), rig.state_file())
    assert len(messages(prefix_log, logging.WARNING)) == 2  # a new burst
    assert "prefix store: storing works again" in messages(prefix_log)
    store.close()


def mounted_tmpfs(mount_point: Path, options: str) -> Iterator[Path]:
    """A tmpfs of our own; the test is skipped (saying why) where this process may not mount one."""
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    yield from mounted_tmpfs(tmp_path / "small", "size=1m")


@pytest.fixture
def read_only_tmpfs(tmp_path: Path) -> Iterator[Path]:
    yield from mounted_tmpfs(tmp_path / "ro", "ro,size=1m")


async def test_a_really_full_file_system_drops_the_entry_and_keeps_the_store_usable(
    rig: Rig, small_tmpfs: Path
) -> None:
    store = await open_private(small_tmpfs / "store", fingerprint=FINGERPRINT, max_bytes=8 * 1024 * KIB, min_tokens=1)
    assert store is not None
    source = rig.state_file(2 * 1024 * KIB)  # on another file system: copied, and the copy fails
    assert not await store.put_file(tokens(100), source)
    assert not source.exists()
    assert sorted(p.name for p in (small_tmpfs / "store").iterdir()) == [".lock"]
    assert store.statistics().store_failures == 1
    assert await store.put_file(tokens(100), rig.state_file(100 * KIB))
    assert store.lookup(tokens(100)) is not None
    store.close()


async def test_a_store_directory_that_cannot_be_made_disables_the_store_with_one_line(
    rig: Rig, prefix_log: pytest.LogCaptureFixture
) -> None:
    blocker = rig.state_dir.parent / "a-file"
    blocker.write_text("")
    store = await open_private(blocker / "store", fingerprint=FINGERPRINT, max_bytes=KIB, min_tokens=1)
    assert store is None
    assert messages(prefix_log) == [f"prefix store: off: {blocker}/store: Not a directory"]


class ReadOnlyDisk(Disk):
    def write(self, target: Path, data: bytes) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))


async def test_a_store_directory_that_cannot_be_written_disables_the_store(
    rig: Rig, prefix_log: pytest.LogCaptureFixture
) -> None:
    store = await rig.try_open(disk=ReadOnlyDisk())
    assert store is None
    assert messages(prefix_log) == [f"prefix store: off: {rig.store_dir}: Read-only file system"]


async def test_a_read_only_mount_disables_the_store(
    read_only_tmpfs: Path, prefix_log: pytest.LogCaptureFixture
) -> None:
    store = await open_private(read_only_tmpfs, fingerprint=FINGERPRINT, max_bytes=KIB, min_tokens=1)
    assert store is None
    assert messages(prefix_log) == [f"prefix store: off: {read_only_tmpfs}: Read-only file system"]


async def test_a_second_store_on_the_same_directory_is_disabled_until_the_first_closes(rig: Rig) -> None:
    first = await rig.try_open()
    second = await rig.try_open()
    assert first is not None
    assert second is None
    first.close()
    third = await rig.try_open()
    assert third is not None
    third.close()


# -- concurrency: a reader never sees half an entry -------------------------------------------------


class SlowDisk(Disk):
    """Holds the sidecar's write (the commit) until the test lets it go."""

    def __init__(self) -> None:
        self.writing = threading.Event()
        self.go_on = threading.Event()

    def write(self, target: Path, data: bytes) -> None:
        if target.name.endswith(".json"):
            self.writing.set()
            assert self.go_on.wait(timeout=30)
        super().write(target, data)


async def test_a_lookup_during_a_write_sees_no_entry_until_it_is_committed(rig: Rig) -> None:
    disk = SlowDisk()
    store = await rig.open(disk=disk)
    prefix = tokens(100)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            done: list[bool] = []

            async def put() -> None:
                done.append(await store.put_file(prefix, rig.state_file()))

            nursery.start_soon(put)
            await trio.to_thread.run_sync(disk.writing.wait)
            # The state file is in place under its final name, the sidecar is not: not an entry.
            assert f"{token_key(prefix)}.state" in rig.files()
            assert store.lookup([*prefix, 1]) is None
            assert store.statistics().entries == 0
            disk.go_on.set()
    assert done == [True]
    assert store.lookup([*prefix, 1]) is not None
    store.close()


async def test_puts_past_the_pending_limit_are_refused_and_a_pending_duplicate_is_a_no_op(rig: Rig) -> None:
    disk = SlowDisk()
    store = await rig.open(disk=disk)
    results: dict[int, bool] = {}

    async def put(i: int) -> None:
        results[i] = await store.put_file(tokens(100, i * 1000), rig.state_file())

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(put, 0)
            await trio.to_thread.run_sync(disk.writing.wait)  # put 0 holds the disk
            for i in range(1, MAX_PENDING_PUTS):
                nursery.start_soon(put, i)
            await trio.testing.wait_all_tasks_blocked()
            assert not store.wants(tokens(100, 9000))
            refused = rig.state_file()
            assert not await store.put_file(tokens(100, 9000), refused)
            assert not refused.exists()
            assert await store.put_file(tokens(100, 1000), rig.state_file())  # pending: a no-op
            disk.go_on.set()
    assert results == dict.fromkeys(range(MAX_PENDING_PUTS), True)
    stats = store.statistics()
    assert (stats.entries, stats.skipped, stats.duplicates) == (MAX_PENDING_PUTS, 1, 1)
    assert store.wants(tokens(100, 9000))
    store.close()


async def test_a_put_cancelled_by_its_caller_still_finishes_and_is_accounted(rig: Rig) -> None:
    disk = SlowDisk()
    store = await rig.open(disk=disk)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.put_file, tokens(100), rig.state_file())
            await trio.to_thread.run_sync(disk.writing.wait)
            nursery.cancel_scope.cancel()
            disk.go_on.set()
    assert store.statistics().entries == 1
    assert store.statistics().bytes == rig.disk_bytes()
    store.close()


class PriorityDisk(Disk):
    """Records the nice value of the thread that copies a state file in."""

    def __init__(self) -> None:
        self.nice: list[int] = []

    def move_in(self, source: Path, target: Path) -> None:
        self.nice.append(os.getpriority(os.PRIO_PROCESS, 0))
        super().move_in(source, target)


async def test_a_puts_hash_and_copy_run_at_nice_19_and_other_threads_keep_their_priority(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On cores it shares with the decoder, a put's tens of ms of CPU would slow the request beside it
    # (supervisor/prefix/background.py).  The event loop's thread and trio's worker threads keep theirs.
    hashed: list[int] = []
    digest = prefix_files.digest

    def recording(path: Path) -> str:
        hashed.append(os.getpriority(os.PRIO_PROCESS, 0))
        return digest(path)

    ours = os.getpriority(os.PRIO_PROCESS, 0)
    if ours >= NICE:
        pytest.skip(f"the tests run at nice {ours} already")
    monkeypatch.setattr(prefix_files, "digest", recording)
    disk = PriorityDisk()
    store = await rig.open(disk=disk)
    try:
        with trio.fail_after(30):
            assert await store.put_file(tokens(100), rig.state_file())
            assert await store.put_file(tokens(200), rig.state_file())
            worker = await trio.to_thread.run_sync(os.getpriority, os.PRIO_PROCESS, 0)
    finally:
        store.close()
    assert hashed == disk.nice == [NICE] * 2
    assert os.getpriority(os.PRIO_PROCESS, 0) == worker == ours
    assert store.statistics().entries == 2


async def test_a_background_jobs_exception_is_raised_to_its_caller_and_the_thread_goes_on() -> None:
    background = Background()

    def fails() -> None:
        raise OSError(errno.ENOSPC, "full")

    try:
        with trio.fail_after(30):
            with pytest.raises(OSError, match="full"):
                await background.run(fails)
            assert await background.run(lambda a, b: a + b, 2, 3) == 5
    finally:
        background.close()


# -- statistics, list, clear ------------------------------------------------------------------------


async def test_statistics_count_hits_misses_stores_and_restore_times(rig: Rig) -> None:
    store = await rig.open()
    assert await store.put_file(tokens(100), rig.state_file())
    assert store.lookup(tokens(150)) is not None
    assert store.lookup(tokens(50)) is None
    store.record_restore(10.0)
    store.record_restore(30.0)
    stats = store.statistics()
    assert (stats.hits, stats.misses, stats.stores, stats.restores) == (1, 1, 1, 1 + 1)
    assert stats.restore_ms_mean == 20.0
    assert stats.restore_ms_last == 30.0
    assert stats.directory == str(rig.store_dir)
    assert configuration.converter.unstructure(stats)["bytes"] == rig.disk_bytes()
    store.close()


async def test_clear_removes_every_entry_and_a_pinned_one_at_its_release(rig: Rig) -> None:
    store = await rig.open()
    for i in range(3):
        assert await store.put_file(tokens(100, i * 1000), rig.state_file())
    pinned = store.lookup(tokens(100))
    assert pinned is not None
    async with store.exposed(pinned, rig.state_dir):
        assert await store.clear() == 3
        assert store.list() == []
        assert len(rig.files()) == 2
    assert rig.files() == []
    assert store.statistics().bytes == 0
    store.close()


# -- from the config --------------------------------------------------------------------------------


async def test_the_store_is_opened_where_the_config_says_with_the_decoders_fingerprint(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    config = make_config(tmp_path, model={"path": str(model)}, cache={"dir": str(tmp_path / "p"), "min_tokens": 5})
    async with open_prefix_store(config, "version: 9") as store:
        assert store is not None
        assert store.directory == tmp_path / "p"
        assert store.min_tokens == 5
        assert store.fingerprint == StateFingerprint.of(config, "version: 9")
    off = make_config(tmp_path, model={"path": str(model)}, cache={"enabled": False, "dir": str(tmp_path / "q")})
    async with open_prefix_store(off, "version: 9") as store:
        assert store is None
    assert not (tmp_path / "q").exists()


def test_the_default_store_directory_follows_systemd_then_xdg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHE_DIRECTORY", "/var/cache/onebit:/elsewhere")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert locate.prefix_store_dir("") == Path("/var/cache/onebit/prefix")
    assert locate.prefix_store_dir("/my/store") == Path("/my/store")
    monkeypatch.delenv("CACHE_DIRECTORY")
    assert locate.prefix_store_dir("") == Path("/xdg/onebit/prefix")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "/home/someone")
    assert locate.prefix_store_dir("") == Path("/home/someone/.cache/onebit/prefix")


async def test_every_llama_server_child_is_started_with_an_explicit_cache_ram(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    for ram, expected in ((None, "1024"), (0, "0"), (-1, "-1")):
        cache = {} if ram is None else {"ram_mib": ram}
        config = make_config(tmp_path, model={"path": str(model)}, cache=cache)
        launcher = LlamaServerLauncher(
            "decoder",
            config,
            binary=str(binary),
            client=DecoderClient(tmp_path / "d.sock"),
            slot_save_path=tmp_path / "state",
            threads=0,
            extra_args=("--cache-ram", "7"),
        )
        argv = list(launcher.argv())
        await launcher.client.aclose()
        at = argv.index("--cache-ram")
        assert argv[at + 1] == expected
        assert argv[-2:] == ["--cache-ram", "7"]  # extra_args come last: llama-server's last one wins
    assert prefix_files.FORMAT == 1


async def test_each_entry_stored_evicted_restored_or_dropped_is_told_as_it_happens(rig: Rig) -> None:
    """The live feed's store events (the status page, docs/protocol.md): sizes and origin, never tokens."""
    store = await rig.open(max_bytes=30 * KIB, host_id="host-a")  # room for two
    events: list[dict[str, object]] = []
    store.on_event = events.append
    a, b, c = tokens(100, 0), tokens(100, 1000), tokens(100, 2000)
    assert await store.put_file(a, rig.state_file())
    assert await store.put_file(b, rig.state_file())
    assert await store.put_file(c, rig.state_file())  # evicts a, the least recently used
    entry_b = store.lookup(b)
    assert entry_b is not None
    store.record_restore(12.34, entry_b)
    store.drop(entry_b)
    store.close()
    size = 10 * KIB  # the state file; the sidecar's bytes come on top
    assert [e["what"] for e in events] == ["stored", "stored", "evicted", "stored", "restored", "dropped"]
    assert all(e["tokens"] == 100 and int(str(e["bytes"])) >= size and e["origin_host"] == "host-a" for e in events)
    assert (events[4]["ms"], events[5]["why"]) == (12.3, "refused by the decoder")
    assert not any(isinstance(v, list) for e in events for v in e.values())  # no tokens in any
