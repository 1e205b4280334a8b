"""A prefix store the hosts share (cache.shared_dir), without llama-server: two stores on one directory
with different host ids read each other's entries, never restore one of another fingerprint, never
take a dead writer's temporary file for an entry (and remove it once old), evict one budget together
without losing what they still need or passing it by more than one entry, and a shared directory that
cannot be used leaves the host on its private store.

State files are made up as in tests/unit/prefix/test_prefix_store.py (llama.cpp's magic, then filler bytes).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from supervisor.admin import render
from supervisor.errors import PrefixStoreError
from supervisor.llama.statefile import MAGIC_BYTES as STATE_MAGIC
from supervisor.observe import metrics
from supervisor.prefix import files as prefix_files
from supervisor.prefix import shared
from supervisor.prefix.fallback import FallbackDirectory
from supervisor.prefix.index import token_key
from supervisor.prefix.opening import open_prefix_store, open_shared
from supervisor.prefix.shareddir import SharedDirectory
from supervisor.prefix.store import PrefixStore
from tests.fakes import shared_store_writer
from tests.rigs.rig import make_config
from tests.unit.prefix.test_prefix_store import FINGERPRINT, KIB, MIN_TOKENS, tokens

TIMEOUT = 30
REPO = Path(__file__).parents[3]
ENTRY = 10 * KIB  # a state file's size here; its sidecar adds a few hundred bytes
DAY = 86400.0


@attrs.define
class Hosts:
    """One shared directory, and a state directory per host (llama-server's, a tmpfs in production)."""

    shared_dir: Path
    root: Path
    made: int = 0

    def state_file(self, size: int = ENTRY) -> Path:
        self.made += 1
        path = self.root / f"saved-{self.made}-{threading.get_ident()}.state"
        path.write_bytes(STATE_MAGIC + b"\0" * (size - len(STATE_MAGIC)))
        return path

    async def open(self, host: str, max_bytes: int = 1024 * KIB, **kwargs: object) -> PrefixStore:
        options: dict[str, object] = {
            "host_id": host,
            "fingerprint": FINGERPRINT,
            "max_bytes": max_bytes,
            "min_tokens": MIN_TOKENS,
            "max_age_s": DAY,
        }
        options.update(kwargs)
        return await open_shared(self.shared_dir, **options)  # type: ignore[arg-type]

    def committed(self) -> list[str]:
        """Names of the committed entries on disk now (whole: sidecar and state file of its size)."""
        names = []
        for path in self.shared_dir.iterdir():
            if path.name.startswith(".") or not path.name.endswith(prefix_files.SIDECAR):
                continue
            stem = path.name[: -len(prefix_files.SIDECAR)]
            try:  # another host may evict it between the listing and here
                sidecar = json.loads(path.read_bytes())
                size = prefix_files.state_path(self.shared_dir, stem).stat().st_size
            except FileNotFoundError:
                continue
            assert size == sidecar["state_bytes"], stem
            names.append(stem)
        return sorted(names)

    def committed_bytes(self) -> int:
        total = 0
        for stem in self.committed():
            try:
                sizes = [prefix_files.state_path(self.shared_dir, stem).stat().st_size]
                sizes.append(prefix_files.sidecar_path(self.shared_dir, stem).stat().st_size)
            except FileNotFoundError:
                continue  # evicted meanwhile
            total += sum(sizes)
        return total


def age_limit(store: PrefixStore, max_age_s: float) -> None:
    """A shared store's ``cache.shared_max_age_s`` lowered while it runs."""
    assert isinstance(store.io, SharedDirectory)
    store.io.max_age_s = max_age_s


@pytest.fixture
def hosts(tmp_path: Path) -> Hosts:
    return Hosts(tmp_path / "shared", tmp_path)


@pytest.fixture
def prefix_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="onebit.prefix")
    return caplog


def messages(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "onebit.prefix" and r.levelno >= level]


async def test_two_hosts_read_each_others_entries_and_know_whose_they_are(hosts: Hosts) -> None:
    with trio.fail_after(TIMEOUT):
        a = await hosts.open("host-a")
        b = await hosts.open("host-b")
        assert await a.put_file(tokens(100), hosts.state_file())
        assert b.lookup(tokens(120)) is None  # not read yet: B reads the directory at its next rescan
        await b.refresh()
        entry = b.lookup(tokens(120))
        assert entry is not None
        assert (entry.n_tokens, entry.origin_host, b.from_other_host(entry)) == (100, "host-a", True)
        async with b.exposed(entry, hosts.root) as name:
            assert (hosts.root / name).read_bytes()[:4] == STATE_MAGIC
        b.record_restore(3.0, entry)
        stats = b.statistics()
        assert (stats.shared, stats.host_id, stats.restores, stats.restores_other) == (True, "host-b", 1, 1)
        # B does not store what A already holds; its own new prompt is A's to read in turn.
        assert not b.wants(tokens(100))
        assert await b.put_file(tokens(200, start=1000), hosts.state_file())
        await a.refresh()
        mine = a.lookup(tokens(120))
        assert mine is not None
        assert not a.from_other_host(mine)
        theirs = a.lookup(tokens(210, start=1000))
        assert theirs is not None
        assert theirs.origin_host == "host-b"
        assert sorted(shared.host_of(name) or "" for name in hosts.committed()) == ["host-a", "host-b"]
        a.close()
        b.close()


async def test_two_hosts_storing_the_same_prompt_at_once_make_two_whole_entries_never_a_torn_one(
    hosts: Hosts,
) -> None:
    with trio.fail_after(TIMEOUT):
        a = await hosts.open("host-a")
        b = await hosts.open("host-b")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.put_file, tokens(100), hosts.state_file())
            nursery.start_soon(b.put_file, tokens(100), hosts.state_file(ENTRY + 512))
        assert len(hosts.committed()) == 2  # committed() checks each state file against its sidecar
        await a.refresh()
        assert a.statistics().entries == 2
        assert a.lookup(tokens(100)) is not None


async def test_an_entry_of_another_fingerprint_is_never_restored_and_is_left_to_its_host(hosts: Hosts) -> None:
    with trio.fail_after(TIMEOUT):
        other = attrs.evolve(FINGERPRINT, server_version="version: 2 (another build)")
        old = await hosts.open("old-build", fingerprint=other)
        new = await hosts.open("new-build")
        assert await old.put_file(tokens(100), hosts.state_file())
        await new.refresh()
        assert new.lookup(tokens(120)) is None
        assert new.statistics().entries == 0
        assert new.wants(tokens(100))  # its own entry for the prompt, of its own fingerprint
        assert len(hosts.committed()) == 1  # the other build's entry stays: it is its host's
        await old.refresh()
        assert old.lookup(tokens(120)) is not None


async def test_a_killed_writers_temporary_files_are_never_an_entry_and_go_once_old(
    hosts: Hosts, prefix_log: pytest.LogCaptureFixture
) -> None:
    """A writer SIGKILLed mid-write leaves what write_entry had made so far: a temporary state file, a
    state file renamed in without its sidecar, a temporary sidecar.  Made here by hand (a kill at an
    exact step is not deterministic), with the names write_entry gives them."""
    with trio.fail_after(TIMEOUT):
        hosts.shared_dir.mkdir()
        key = token_key(tokens(100))
        name = f"{key}~dead-host~0badf00d"
        sidecar = prefix_files.render_sidecar(
            tuple(tokens(100)), FINGERPRINT.as_json(), ENTRY, time.time(), "dead", blake2b="00" * 16
        )
        left = [
            hosts.shared_dir / f"{prefix_files.TEMP_PREFIX}{name}-1234abcd.state",
            prefix_files.state_path(hosts.shared_dir, name),  # renamed in, its sidecar never was
            hosts.shared_dir / f"{prefix_files.TEMP_PREFIX}{name}-1234abcd.json",
        ]
        left[0].write_bytes(STATE_MAGIC + b"\0" * (ENTRY // 2 - len(STATE_MAGIC)))  # half written
        left[1].write_bytes(STATE_MAGIC + b"\0" * (ENTRY - len(STATE_MAGIC)))
        left[2].write_bytes(sidecar)
        store = await hosts.open("host-b")
        assert store.lookup(tokens(100)) is None
        assert store.statistics().entries == 0
        assert all(path.exists() for path in left)  # young: maybe a live host's write in progress
        hour_ago = time.time() - 3600
        for path in left:
            os.utime(path, (hour_ago, hour_ago))
        await store.refresh()
        assert all(path.exists() for path in left)  # younger than max_age_s still
        age_limit(store, 60)
        await store.refresh()
        assert not any(path.exists() for path in left)
        assert store.lookup(tokens(100)) is None
        assert len([m for m in messages(prefix_log) if "removing" in m]) == 3
        store.close()


async def test_an_entry_no_host_used_for_max_age_is_evicted_by_whichever_host_sees_it(hosts: Hosts) -> None:
    with trio.fail_after(TIMEOUT):
        a = await hosts.open("host-a")
        b = await hosts.open("host-b", max_age_s=60)
        assert await a.put_file(tokens(100), hosts.state_file())
        assert await a.put_file(tokens(100, start=500), hosts.state_file())
        (old,) = [n for n in hosts.committed() if n.startswith(token_key(tokens(100)))]
        hour_ago = time.time() - 3600
        os.utime(prefix_files.state_path(hosts.shared_dir, old), (hour_ago, hour_ago))
        await b.refresh()
        assert b.lookup(tokens(100)) is None
        assert b.lookup(tokens(100, start=500)) is not None
        assert b.statistics().evictions == 1
        await a.refresh()  # A's index learns that it went
        assert a.lookup(tokens(100)) is None
        assert len(hosts.committed()) == 1


async def test_an_entry_another_host_evicted_after_our_lookup_fails_its_restore_cleanly(hosts: Hosts) -> None:
    with trio.fail_after(TIMEOUT):
        a = await hosts.open("host-a")
        b = await hosts.open("host-b")
        assert await a.put_file(tokens(100), hosts.state_file())
        await b.refresh()
        entry = b.lookup(tokens(100))
        assert entry is not None
        assert await a.clear() == 1
        with pytest.raises(PrefixStoreError, match="another host evicted it"):
            async with b.exposed(entry, hosts.root):
                pytest.fail("exposed an entry that is gone")
        assert b.lookup(tokens(100)) is None
        assert list(hosts.root.glob("prefix-*")) == []
        assert b.statistics().pinned == 0


def test_of_two_hosts_evicting_one_entry_exactly_one_removes_it(hosts: Hosts) -> None:
    hosts.shared_dir.mkdir()
    results: list[bool] = []
    for round_ in range(50):
        name = f"{token_key(tokens(100, start=round_))}~host-a~{round_:08x}"
        prefix_files.state_path(hosts.shared_dir, name).write_bytes(b"state")
        prefix_files.sidecar_path(hosts.shared_dir, name).write_bytes(b"{}")
        start = threading.Barrier(2)
        won: list[bool] = []

        def evict(host: str, name: str = name, start: threading.Barrier = start, won: list[bool] = won) -> None:
            start.wait()
            won.append(shared.evict(hosts.shared_dir, name, host))

        threads = [threading.Thread(target=evict, args=(host,)) for host in ("host-b", "host-c")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
        results.append(sorted(won) == [False, True])
    assert all(results)
    assert list(hosts.shared_dir.iterdir()) == []


@attrs.define
class Filled:
    """What the hosts of one fill stored: each entry's use time (its state file's mtime) and the
    committed bytes on disk after each put."""

    used: dict[str, float] = attrs.Factory(dict)
    seen: list[int] = attrs.Factory(list)


async def fill(
    store: PrefixStore, hosts: Hosts, start: int, count: int, filled: Filled, keep: list[int] | None
) -> None:
    """``count`` puts of new prompts by ``store``; after each, the prompt ``keep`` is used again (a
    conversation that goes on), when given."""
    for i in range(count):
        prompt = tokens(64, start=start + i * 100)
        source = hosts.state_file()
        mtime = source.stat().st_mtime
        assert await store.put_file(prompt, source)
        filled.seen.append(hosts.committed_bytes())
        found = store.lookup(prompt)
        assert found is not None
        filled.used[found.key] = mtime
        if keep is not None:
            kept = store.lookup(keep)
            if kept is None:
                continue  # evicted: the invariant below says whether it should have been
            with contextlib.suppress(PrefixStoreError):
                async with store.exposed(kept, hosts.root):
                    filled.used[kept.key] = os.stat(prefix_files.state_path(hosts.shared_dir, kept.key)).st_mtime


def assert_least_recently_used_went_first(hosts: Hosts, filled: Filled, budget: int, one: int) -> None:
    """Within the budget but for one entry at every moment; no entry outlived one used later than it."""
    assert max(filled.seen) <= budget + one, (filled.seen, budget, one)
    left = set(hosts.committed())
    gone = [used for name, used in filled.used.items() if name not in left]
    kept = [used for name, used in filled.used.items() if name in left]
    assert gone
    assert max(gone) <= min(kept)


async def entry_bytes(hosts: Hosts) -> int:
    probe = await hosts.open("probe")
    assert await probe.put_file(tokens(64, start=10**6), hosts.state_file())
    one = probe.statistics().bytes
    await probe.clear()
    return one + 16  # a sidecar's size varies by a few bytes with its numbers


async def test_two_hosts_filling_one_budget_at_once_stay_within_it_but_for_one_entry_least_recently_used_first(
    hosts: Hosts,
) -> None:
    with trio.fail_after(TIMEOUT):
        one = await entry_bytes(hosts)
        budget = 5 * one
        a = await hosts.open("host-a", max_bytes=budget)
        b = await hosts.open("host-b", max_bytes=budget)
        conversation = tokens(64, start=-10_000)
        assert await a.put_file(conversation, hosts.state_file())
        filled = Filled()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fill, a, hosts, 0, 12, filled, conversation)
            nursery.start_soon(fill, b, hosts, 100_000, 12, filled, None)
        assert_least_recently_used_went_first(hosts, filled, budget, one)


async def test_an_entry_one_host_keeps_using_is_never_evicted_by_another_filling_the_budget(hosts: Hosts) -> None:
    with trio.fail_after(TIMEOUT):
        one = await entry_bytes(hosts)
        a = await hosts.open("host-a", max_bytes=3 * one)
        b = await hosts.open("host-b", max_bytes=3 * one)
        conversation = tokens(64, start=-10_000)
        assert await a.put_file(conversation, hosts.state_file())
        for turn in range(10):
            assert await b.put_file(tokens(64, start=turn * 100), hosts.state_file())
            await a.refresh()
            entry = a.lookup(conversation)
            assert entry is not None, f"evicted at turn {turn}"
            async with a.exposed(entry, hosts.root):
                pass  # a restore: a use, the entry's mtime now
        assert b.statistics().evictions >= 8
        assert len(hosts.committed()) == 3


def test_two_hosts_in_two_threads_filling_one_budget_stay_within_it_but_for_one_entry(hosts: Hosts) -> None:
    """Each host's trio in its own thread, as two processes would be: only the file system between them."""
    one = trio.run(entry_bytes, hosts)
    budget = 4 * one
    filled = Filled()
    failures: list[BaseException] = []

    def host(name: str, start: int) -> None:
        async def main() -> None:
            with trio.fail_after(TIMEOUT):
                await fill(await hosts.open(name, max_bytes=budget), hosts, start, 12, filled, None)

        try:
            trio.run(main)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=host, args=(name, start)) for name, start in (("a", 0), ("b", 100_000))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert failures == []
    assert_least_recently_used_went_first(hosts, filled, budget, one)


async def test_a_shared_directory_under_a_file_leaves_the_host_on_its_private_store_with_one_line(
    tmp_path: Path, prefix_log: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(TIMEOUT):
        model = tmp_path / "m.gguf"
        model.write_bytes(b"GGUF")
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        cache = {"dir": str(tmp_path / "private"), "shared_dir": str(blocker / "shared")}
        config = make_config(tmp_path, model={"path": str(model)}, server={"host_id": "h1"}, cache=cache)
        async with open_prefix_store(config, "version: 9") as store:
            assert store is not None
            assert store.directory == tmp_path / "private"
            stats = store.statistics()
            assert (stats.shared, stats.host_id) == (False, "h1")
            assert stats.shared_problem == f"{blocker}/shared: Not a directory"
            source = tmp_path / "saved.state"
            source.write_bytes(STATE_MAGIC + b"\0" * 100)
            assert await store.put_file(tokens(300), source)  # a request's store goes on, privately
        assert [m for m in messages(prefix_log, logging.WARNING)] == [
            f"prefix store: cannot use the shared directory {blocker}/shared: Not a directory;"
            f" this host stores privately in {tmp_path / 'private'}"
        ]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes a mode 000 directory")
async def test_a_shared_directory_it_may_not_enter_leaves_the_host_on_its_private_store(
    tmp_path: Path, prefix_log: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(TIMEOUT):
        model = tmp_path / "m.gguf"
        model.write_bytes(b"GGUF")
        closed = tmp_path / "closed"
        closed.mkdir(mode=0)
        try:
            cache = {"dir": str(tmp_path / "private"), "shared_dir": str(closed / "shared")}
            config = make_config(tmp_path, model={"path": str(model)}, cache=cache)
            async with open_prefix_store(config, "version: 9") as store:
                assert store is not None
                assert store.directory == tmp_path / "private"
                assert store.statistics().shared_problem == f"{closed}/shared: Permission denied"
        finally:
            closed.chmod(0o700)
        assert any("cannot use the shared directory" in m for m in messages(prefix_log, logging.WARNING))


async def test_a_usable_shared_directory_is_not_locked_and_says_so_in_one_line_at_start(
    tmp_path: Path, prefix_log: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(TIMEOUT):
        model = tmp_path / "m.gguf"
        model.write_bytes(b"GGUF")
        cache = {"dir": str(tmp_path / "private"), "shared_dir": str(tmp_path / "shared")}
        first = make_config(tmp_path, model={"path": str(model)}, server={"host_id": "h1"}, cache=cache)
        second = make_config(tmp_path, model={"path": str(model)}, server={"host_id": "h2"}, cache=cache)
        async with open_prefix_store(first, "v") as one, open_prefix_store(second, "v") as two:
            assert one is not None
            assert two is not None
            assert (one.shared, two.shared) == (True, True)
            assert one.directory == two.directory == tmp_path / "shared"
        assert not (tmp_path / "shared" / ".lock").exists()
        said = [m for m in messages(prefix_log) if m.startswith("prefix store: shared:")]
        assert said == [
            f"prefix store: shared: {tmp_path / 'shared'} as host {h}: 0 entries (0 of other hosts),"
            " 0 bytes of 4294967296 for all hosts"
            for h in ("h1", "h2")
        ]


async def test_a_shared_directory_lost_while_running_is_said_once_and_fails_no_put(
    hosts: Hosts, prefix_log: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(TIMEOUT):
        store = await hosts.open("host-a")
        assert await store.put_file(tokens(100), hosts.state_file())
        lost = hosts.shared_dir.rename(hosts.root / "unmounted")
        await store.refresh()
        await store.refresh()
        source = hosts.state_file()
        assert not await store.put_file(tokens(100, start=7), source)
        assert not source.exists()
        assert store.statistics().shared_problem == "unreachable: No such file or directory"
        unreachable = [m for m in messages(prefix_log, logging.WARNING) if "unreachable" in m]
        assert len(unreachable) == 1
        lost.rename(hosts.shared_dir)
        await store.refresh()
        assert store.statistics().shared_problem is None
        assert store.lookup(tokens(100)) is not None
        assert "prefix store: shared directory" in messages(prefix_log)[-1]


async def test_status_and_metrics_count_the_restores_of_other_hosts_entries(hosts: Hosts) -> None:
    with trio.fail_after(TIMEOUT):
        a = await hosts.open("host-a")
        b = await hosts.open("host-b")
        assert await a.put_file(tokens(100), hosts.state_file())
        assert await b.put_file(tokens(100, start=500), hosts.state_file())
        await b.refresh()
        for prompt in (tokens(100), tokens(100, start=500), tokens(100)):
            entry = b.lookup(prompt)
            assert entry is not None
            b.record_restore(2.0, entry)
        stats = b.statistics()
    assert (stats.restores, stats.restores_other) == (3, 2)
    line = render._store_line(stats)
    assert line.endswith("restores 3 (mean 2.0 ms), 2 from other hosts; shared, as host host-b"), line
    families = {family.name: family for family in metrics._stores([(None, stats)])}
    origin = {s.labels["origin"]: s.value for s in families["onebit_prefix_store_origin_restores"].samples}
    assert origin == {"self": 1, "other": 2}
    assert families["onebit_prefix_store_shared"].samples[0].value == 1.0
    fell_back = attrs.evolve(stats, shared=False, shared_problem="/mnt/x: Not a directory")
    assert render._store_line(fell_back).endswith("; shared directory: /mnt/x: Not a directory")


async def kill_a_writer(hosts: Hosts, where: str) -> list[str]:
    """tests/fakes/shared_store_writer.py (host ``doomed``) SIGKILLed half way through ``where`` (the state
    file's copy, or the sidecar, fsynced there): the files it left."""
    hosts.shared_dir.mkdir(exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "tests.fakes.shared_store_writer",
        str(hosts.shared_dir),
        str(hosts.state_file()),
        where,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    async with trio.open_nursery() as nursery:
        run = functools.partial(trio.run_process, command, stdout=subprocess.PIPE, check=False, cwd=REPO, env=env)
        writer: trio.Process = await nursery.start(run)
        assert writer.stdout is not None
        said = b""
        while shared_store_writer.STUCK.encode() not in said:
            chunk = await writer.stdout.receive_some()
            assert chunk, f"the writer ended before it was half way: {said!r}"
            said += chunk
        writer.kill()
    assert writer.returncode == -signal.SIGKILL
    return sorted(path.name for path in hosts.shared_dir.iterdir())


@pytest.mark.parametrize("where", ["state", "sidecar"])
async def test_a_writer_sigkilled_mid_write_leaves_nothing_another_host_restores(hosts: Hosts, where: str) -> None:
    """A real kill: tests/fakes/shared_store_writer.py stops dead half way through the state file's copy or
    through the sidecar (fsynced), and is SIGKILLed there."""
    with trio.fail_after(TIMEOUT):
        left = await kill_a_writer(hosts, where)
        assert len(left) == (1 if where == "state" else 2), left
        survivor = await hosts.open("survivor")
        assert survivor.lookup(tokens(100)) is None
        assert survivor.statistics().entries == 0
        hour_ago = time.time() - 3600
        for path in hosts.shared_dir.iterdir():
            os.utime(path, (hour_ago, hour_ago))
        age_limit(survivor, 60)
        await survivor.refresh()
        assert list(hosts.shared_dir.iterdir()) == []
        assert await survivor.put_file(tokens(100), hosts.state_file())  # stored whole, by the survivor
        assert len(hosts.committed()) == 1


async def test_a_request_whose_prompt_the_index_covers_badly_reads_the_directory_again_at_once(
    hosts: Hosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drained host's hand-over is found by the next turn at once, not at the next rescan."""
    with trio.fail_after(TIMEOUT):
        a = await hosts.open("host-a")
        b = await hosts.open("host-b")
        assert await a.put_file(tokens(100), hosts.state_file())
        assert b.lookup(tokens(120)) is None
        b._listed_at = float("-inf")  # B listed the directory at its open, a moment ago
        entry = await b.find(tokens(120))
        assert entry is not None
        assert entry.origin_host == "host-a"
        listings: list[object] = []
        original = shared.listing

        def counted(*args: Any, **kwargs: Any) -> shared.Listing:
            listings.append(args)
            return original(*args, **kwargs)

        monkeypatch.setattr(shared, "listing", counted)
        assert await b.find(tokens(150, start=5000)) is None  # read just now: not again yet
        b._listed_at = float("-inf")
        assert await b.find(tokens(105)) == entry  # covered but for fewer than min_tokens
        assert await b.find(tokens(MIN_TOKENS - 1, start=9000)) is None  # too short for any entry
        assert listings == []
        assert await b.find(tokens(150, start=5000)) is None
        assert len(listings) == 1


async def test_a_shared_directory_lost_while_running_sends_the_puts_to_the_private_store_until_it_is_back(
    tmp_path: Path, prefix_log: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(TIMEOUT):
        model = tmp_path / "m.gguf"
        model.write_bytes(b"GGUF")
        shared_dir, private = tmp_path / "shared", tmp_path / "private"
        cache = {"dir": str(private), "shared_dir": str(shared_dir), "min_tokens": MIN_TOKENS}
        config = make_config(tmp_path, model={"path": str(model)}, server={"host_id": "h1"}, cache=cache)
        hosts = Hosts(shared_dir, tmp_path)
        async with open_prefix_store(config, "v") as store:
            assert store is not None
            assert isinstance(store.io, FallbackDirectory)
            assert await store.put_file(tokens(100), hosts.state_file())
            lost = shared_dir.rename(tmp_path / "unmounted")
            await store.refresh()
            assert store.degraded
            stats = store.statistics()
            assert (stats.shared, stats.shared_problem) == (False, "unreachable: No such file or directory")
            assert store.wants(tokens(100, start=7))
            assert await store.put_file(tokens(100, start=7), hosts.state_file())
            assert [p.name for p in private.glob("*.json")] == [f"{token_key(tokens(100, start=7))}.json"]
            kept = await store.find(tokens(120, start=7))
            assert kept is not None
            assert kept.origin_host == "h1"
            async with store.exposed(kept, tmp_path) as name:
                assert (tmp_path / name).read_bytes()[:4] == STATE_MAGIC
            assert store.statistics().entries == 2  # the shared one known before, the private one
            lost.rename(shared_dir)
            await store.refresh()
            assert not store.degraded
            assert store.statistics().shared
            assert await store.put_file(tokens(100, start=3000), hosts.state_file())
            assert len(hosts.committed()) == 2  # the shared directory's puts go there again
            again = await store.find(tokens(120, start=7))  # what was stored privately stays found
            assert again is not None
            assert again.key == kept.key
        warned = [m for m in messages(prefix_log, logging.WARNING) if "unreachable" in m]
        assert len(warned) == 1
