"""A prefix store that cannot restore wrong state, without llama-server: a state file whose bytes
changed under its committed sidecar (a flipped byte, a truncation) is never restored, but dropped,
said once, and the request goes on as if there were none; an entry without a content hash is not
trusted; a host removes its own leftovers at its start, and leftovers count against ``max_bytes``
until they go; a full shared directory, three hosts on one budget, and a host whose clock is
minutes off.

State files are made up as in tests/unit/prefix/test_prefix_store.py (llama.cpp's magic, then filler bytes).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from supervisor.errors import PrefixStoreError
from supervisor.llama.statefile import MAGIC_BYTES as STATE_MAGIC
from supervisor.prefix import files as prefix_files
from supervisor.prefix import shareddir
from supervisor.prefix.index import token_key
from supervisor.prefix.opening import open_shared
from supervisor.prefix.store import PrefixStore
from tests.unit.prefix.test_prefix_store import FINGERPRINT, KIB, MIN_TOKENS, mounted_tmpfs, private_store, tokens
from tests.unit.prefix.test_shared_store import (
    DAY,
    ENTRY,
    Filled,
    Hosts,
    assert_least_recently_used_went_first,
    entry_bytes,
    fill,
    kill_a_writer,
)

TIMEOUT = 30
MINUTES_OFF = 10 * 60.0


@pytest.fixture
def hosts(tmp_path: Path) -> Hosts:
    return Hosts(tmp_path / "shared", tmp_path)


@pytest.fixture
def prefix_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="onebit.prefix")
    return caplog


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "onebit.prefix" and r.levelno >= logging.WARNING]


def flip_a_byte(path: Path) -> None:
    """One bit of the KV data changed, the size and llama.cpp's magic as they were."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# -- the content hash ---------------------------------------------------------------------------------


async def test_a_state_file_with_a_flipped_byte_is_never_restored_but_dropped_and_said_once(
    tmp_path: Path, prefix_log: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(TIMEOUT):
        hosts = Hosts(tmp_path / "unused", tmp_path)
        store = await private_store(tmp_path / "store", fingerprint=FINGERPRINT, max_bytes=1 << 20, min_tokens=8)
        assert await store.put_file(tokens(100), hosts.state_file())
        entry = store.lookup(tokens(120))
        assert entry is not None
        flip_a_byte(prefix_files.state_path(tmp_path / "store", entry.key))
        with pytest.raises(PrefixStoreError, match="damaged"):
            async with store.exposed(entry, tmp_path):
                pytest.fail("exposed a damaged entry")
        assert store.lookup(tokens(120)) is None  # the next request goes on as if there were none
        assert sorted(p.name for p in (tmp_path / "store").iterdir()) == [".lock"]
        assert [name for name in os.listdir(tmp_path) if name.startswith("prefix-")] == []
        stats = store.statistics()
        assert (stats.drops, stats.pinned, stats.entries, stats.bytes) == (1, 0, 0, 0)
        assert warnings(prefix_log) == [
            f"prefix store: dropping entry {entry.key} (100 tokens): its state file does not match its content hash"
        ]
        store.close()


async def test_a_whole_state_file_is_hashed_once_until_it_is_another_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second restore of a file reads no byte of it; a file renamed over it (another inode, as a
    writer's commit is) is hashed again, and its flipped byte found; a store opened anew hashes again."""
    hashed: list[str] = []
    digest = prefix_files.digest

    def counted(path: Path) -> str:
        hashed.append(path.name)
        return digest(path)

    monkeypatch.setattr(prefix_files, "digest", counted)
    with trio.fail_after(TIMEOUT):
        hosts = Hosts(tmp_path / "unused", tmp_path)
        store = await private_store(tmp_path / "store", fingerprint=FINGERPRINT, max_bytes=1 << 20, min_tokens=8)
        assert await store.put_file(tokens(100), hosts.state_file())
        entry = store.lookup(tokens(120))
        assert entry is not None
        path = prefix_files.state_path(tmp_path / "store", entry.key)
        hashed.clear()  # the put's own hash
        for _ in range(2):
            async with store.exposed(entry, tmp_path):
                pass
        assert hashed == [path.name]
        store.close()
        store = await private_store(tmp_path / "store", fingerprint=FINGERPRINT, max_bytes=1 << 20, min_tokens=8)
        entry = store.lookup(tokens(120))
        assert entry is not None
        async with store.exposed(entry, tmp_path):
            pass
        assert hashed == [path.name, path.name]
        damaged = tmp_path / "damaged"
        damaged.write_bytes(path.read_bytes())
        flip_a_byte(damaged)
        damaged.replace(path)
        with pytest.raises(PrefixStoreError, match="damaged"):
            async with store.exposed(entry, tmp_path):
                pytest.fail("exposed a damaged entry")
        assert hashed == [path.name] * 3
        store.close()


async def test_a_truncated_state_file_under_a_committed_sidecar_is_never_restored_by_another_host(
    hosts: Hosts,
) -> None:
    with trio.fail_after(TIMEOUT):
        a = await hosts.open("host-a")
        b = await hosts.open("host-b")
        assert await a.put_file(tokens(100), hosts.state_file())
        await b.refresh()  # B knows the entry whole: it does not read its sidecar again
        entry = b.lookup(tokens(100))
        assert entry is not None
        os.truncate(prefix_files.state_path(hosts.shared_dir, entry.key), ENTRY // 2)  # a lost write
        with pytest.raises(PrefixStoreError, match="damaged"):
            async with b.exposed(entry, hosts.root):
                pytest.fail("exposed a truncated entry")
        assert b.lookup(tokens(100)) is None
        assert hosts.committed() == []  # removed for every host, through B's tombstone
        assert list(hosts.shared_dir.iterdir()) == []


async def test_a_shared_state_file_not_read_in_time_is_not_restored_and_not_dropped(
    hosts: Hosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hung mount is no damage: the request prefills, the entry stays."""
    with trio.fail_after(TIMEOUT):
        store = await hosts.open("host-a")
        assert await store.put_file(tokens(100), hosts.state_file())
        entry = store.lookup(tokens(100))
        assert entry is not None
        release = threading.Event()

        def hung(path: Path, expected: str) -> bool:
            release.wait(TIMEOUT)
            return True

        monkeypatch.setattr(prefix_files, "matches", hung)
        monkeypatch.setattr(shareddir, "VERIFY_TIMEOUT_S", 0.05)
        try:
            with pytest.raises(PrefixStoreError, match="in time"):
                async with store.exposed(entry, hosts.root):
                    pytest.fail("exposed an entry it could not check")
        finally:
            release.set()
        assert store.lookup(tokens(100)) == entry
        assert (store.statistics().pinned, store.statistics().drops) == (0, 0)


async def test_an_entry_whose_sidecar_has_no_content_hash_is_dropped_at_open(
    tmp_path: Path, prefix_log: pytest.LogCaptureFixture
) -> None:
    """Written by an older onebitd: nothing says its state file is what was saved."""
    hosts = Hosts(tmp_path / "unused", tmp_path)
    directory = tmp_path / "store"
    store = await private_store(directory, fingerprint=FINGERPRINT, max_bytes=1 << 20, min_tokens=8)
    assert await store.put_file(tokens(100), hosts.state_file())
    store.close()
    sidecar = prefix_files.sidecar_path(directory, token_key(tokens(100)))
    document = json.loads(sidecar.read_bytes())
    del document["blake2b"]
    sidecar.write_text(json.dumps(document))
    again = await private_store(directory, fingerprint=FINGERPRINT, max_bytes=1 << 20, min_tokens=8)
    assert again.list() == []
    assert sorted(p.name for p in directory.iterdir()) == [".lock"]
    assert any(prefix_files.UNHASHED in m for m in (r.getMessage() for r in prefix_log.records))
    again.close()


# -- leftovers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["state", "sidecar"])
async def test_a_writer_killed_between_data_and_sidecar_is_cleaned_by_its_own_host_at_start(
    hosts: Hosts, where: str
) -> None:
    with trio.fail_after(TIMEOUT):
        left = await kill_a_writer(hosts, where)
        assert left
        other = await hosts.open("host-b")
        assert sorted(path.name for path in hosts.shared_dir.iterdir()) == left  # young: maybe a live write
        assert other.statistics().bytes == sum((hosts.shared_dir / name).stat().st_size for name in left)
        restarted = await hosts.open("doomed")
        assert list(hosts.shared_dir.iterdir()) == []
        assert restarted.statistics().drops == len(left)
        await other.refresh()
        assert other.statistics().bytes == 0


async def test_leftovers_count_against_max_bytes_until_they_are_removed(hosts: Hosts) -> None:
    with trio.fail_after(TIMEOUT):
        one = await entry_bytes(hosts)
        hosts.shared_dir.mkdir(exist_ok=True)
        name = f"{token_key(tokens(64, start=-1))}~dead-host~0badf00d"
        leftover = hosts.shared_dir / f"{prefix_files.TEMP_PREFIX}{name}-1234abcd.state"
        leftover.write_bytes(STATE_MAGIC + b"\0" * (2 * one - len(STATE_MAGIC)))  # a write in progress, or dead
        store = await hosts.open("host-a", max_bytes=4 * one)
        for i in range(3):
            assert await store.put_file(tokens(64, start=i * 100), hosts.state_file())
        assert store.statistics().evictions == 1  # two entries and the leftover fill the budget
        assert len(hosts.committed()) == 2
        assert store.statistics().bytes <= 4 * one
        assert store.statistics().bytes == hosts.committed_bytes() + leftover.stat().st_size


@pytest.fixture
def small_shared(tmp_path: Path) -> Iterator[Path]:
    yield from mounted_tmpfs(tmp_path / "small", "size=1m")


async def test_a_full_shared_directory_fails_a_put_cleanly_and_its_dead_writer_frees_it_at_restart(
    tmp_path: Path, small_shared: Path
) -> None:
    """The disk fills before max_bytes does: a dead writer's leftover (host ``doomed``) took most of it."""
    with trio.fail_after(TIMEOUT):
        hosts = Hosts(small_shared / "shared", tmp_path)
        hosts.shared_dir.mkdir()
        name = f"{token_key(tokens(64, start=-1))}~doomed~0badf00d"
        leftover = hosts.shared_dir / f"{prefix_files.TEMP_PREFIX}{name}-1234abcd.state"
        leftover.write_bytes(STATE_MAGIC + b"\0" * (700 * KIB - len(STATE_MAGIC)))
        other = await hosts.open("host-b", max_bytes=8 << 20)
        source = hosts.state_file(400 * KIB)
        assert not await other.put_file(tokens(100), source)
        assert not source.exists()
        assert other.statistics().store_failures == 1
        assert sorted(p.name for p in hosts.shared_dir.iterdir()) == [leftover.name]  # nothing half-written
        restarted = await hosts.open("doomed", max_bytes=8 << 20)
        assert not leftover.exists()
        assert await restarted.put_file(tokens(100), hosts.state_file(400 * KIB))
        await other.refresh()
        assert other.lookup(tokens(100)) is not None


# -- hosts ------------------------------------------------------------------------------------------


async def test_three_hosts_filling_one_budget_at_once_stay_within_it_but_for_two_entries_least_recently_used_first(
    hosts: Hosts,
) -> None:
    """Each of two hosts may count the same victim as its room as the third writes: n - 1 entries over."""
    with trio.fail_after(TIMEOUT):
        one = await entry_bytes(hosts)
        budget = 6 * one
        stores = [await hosts.open(f"host-{name}", max_bytes=budget) for name in "abc"]
        conversation = tokens(64, start=-10_000)
        assert await stores[0].put_file(conversation, hosts.state_file())
        filled = Filled()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fill, stores[0], hosts, 0, 10, filled, conversation)
            nursery.start_soon(fill, stores[1], hosts, 100_000, 10, filled, None)
            nursery.start_soon(fill, stores[2], hosts, 200_000, 10, filled, None)
        assert_least_recently_used_went_first(hosts, filled, budget, 2 * one)
        for store in stores:
            await store.refresh()
            assert store.statistics().bytes == hosts.committed_bytes()


async def open_off_by(hosts: Hosts, host: str, off_by: float, max_age_s: float) -> PrefixStore:
    """A host whose own clock is ``off_by`` seconds from the directory's."""
    return await open_shared(
        hosts.shared_dir,
        host_id=host,
        fingerprint=FINGERPRINT,
        max_bytes=1 << 20,
        min_tokens=MIN_TOKENS,
        max_age_s=max_age_s,
        clock=lambda: time.time() + off_by,
    )


async def test_a_host_whose_clock_runs_minutes_ahead_removes_no_live_hosts_work_and_no_fresh_entry(
    hosts: Hosts,
) -> None:
    with trio.fail_after(TIMEOUT):
        live = await hosts.open("host-a", max_age_s=DAY)
        assert await live.put_file(tokens(100), hosts.state_file())
        in_progress = (
            hosts.shared_dir / f"{prefix_files.TEMP_PREFIX}{token_key(tokens(9))}~host-a~01234567-89abcdef.state"
        )
        in_progress.write_bytes(STATE_MAGIC)
        ahead = await open_off_by(hosts, "host-b", MINUTES_OFF, max_age_s=60)
        await ahead.refresh()
        assert in_progress.exists()
        assert len(hosts.committed()) == 1
        assert ahead.lookup(tokens(100)) is not None
        assert ahead.statistics().evictions == 0


async def test_a_host_whose_clock_runs_minutes_behind_still_removes_what_is_old(hosts: Hosts) -> None:
    with trio.fail_after(TIMEOUT):
        hosts.shared_dir.mkdir()
        dead = hosts.shared_dir / f"{prefix_files.TEMP_PREFIX}{token_key(tokens(9))}~dead~01234567-89abcdef.state"
        dead.write_bytes(STATE_MAGIC)
        two_minutes_ago = time.time() - 120
        os.utime(dead, (two_minutes_ago, two_minutes_ago))
        behind = await open_off_by(hosts, "host-b", -MINUTES_OFF, max_age_s=60)
        assert not dead.exists()
        assert behind.statistics().drops == 1
