"""Operating onebitd: the admin verbs, sd_notify, /metrics and the systemd unit.

Against the fake decoder, steered through its control file (``hold`` keeps a stream in flight)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import trio
from prometheus_client.parser import text_string_to_metric_families

from supervisor import config as configuration
from supervisor.admin import verbs as admin
from supervisor.daemon import Daemon
from supervisor.errors import AdminUnavailable, RuntimeDirInUse
from supervisor.models.model import ModelState
from supervisor.supervise.child import ChildState
from supervisor.supervise.notify import Notifier
from tests.rigs.helpers import CHAT, chat, client_for, open_held_streams, streamed_text, wait_until
from tests.rigs.rig import Control, DecoderModes, RouteLines, fake_decoder_config, run_daemon

TIMEOUT = 20
ROOT = Path(__file__).parents[3]


async def status(daemon: Daemon) -> dict[str, Any]:
    reply = await admin.call(daemon.admin.path, "status")
    assert reply["ok"] is True
    result: dict[str, Any] = reply["result"]
    return result


# -- status -----------------------------------------------------------------------------------------


async def test_status_answers_while_the_decoder_loads_then_while_it_serves(short_dir: Path, control: Control) -> None:
    control.set(decoder=DecoderModes(loading=True))
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir), wait_ready=False) as running:
            daemon = running.daemon
            await daemon.models.default.decoder.wait_state(ChildState.STARTING)
            loading = await status(daemon)
            control.set(decoder=DecoderModes())
            # Serving once its model is loaded: the slot context read and the restores probed.
            await daemon.models.default.wait_state(ModelState.LOADED)
            serving = await status(daemon)
    assert loading["daemon"]["state"] == "loading"
    assert loading["children"][0]["state"] == "starting"
    assert serving["daemon"]["state"] == "serving"
    assert serving["children"][0]["name"] == "decoder"
    assert serving["children"][0]["pid"] is not None
    assert serving["slots"] == {
        "total": 2,
        "busy": 0,
        "free": 2,
        "queued": 0,
        "queue_limit": 64,
        "affinity_hits": 0,
        "affinity_misses": 0,
        "keep_waits": 0,
        "keep_waiting": 0,
        "each": [{"slot": 0, "state": "free", "tokens": None}, {"slot": 1, "state": "free", "tokens": None}],
    }
    for key in ("routes", "fallbacks", "first_byte", "inflight", "providers"):
        assert key in serving


async def test_status_says_failed_once_the_decoder_has_failed(short_dir: Path, control: Control) -> None:
    control.set(decoder=DecoderModes(exit=3))
    config = fake_decoder_config(short_dir, decoder={"restart": {"max_failures": 1, "backoff_initial_s": 0.01}})
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config, wait_ready=False) as running:
            await running.daemon.models.default.decoder.wait_state(ChildState.FAILED)
            failed = await status(running.daemon)
    assert failed["daemon"]["state"] == "failed"
    assert failed["children"][0]["last_exit"] == "exit status 3"


async def test_status_lists_requests_in_flight_with_their_route_and_counts_finished_ones(
    short_dir: Path, control: Control
) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            ok = await client.post(CHAT, json=chat("one two"))
            assert ok.status_code == 200
            async with open_held_streams(control, client, "held words"):
                during = await status(running.daemon)
    (inflight,) = during["inflight"]
    assert inflight["route"] == "plain"
    assert inflight["endpoint"] == CHAT
    assert inflight["age_s"] >= 0
    assert during["routes"] == {"plain": 1}
    assert during["first_byte"]["n"] == 1
    assert during["slots"]["busy"] == 1


# -- drain and resume -------------------------------------------------------------------------------


async def test_drain_refuses_new_requests_and_lets_the_ones_in_flight_finish_with_their_full_reply(
    short_dir: Path, control: Control, route_lines: RouteLines
) -> None:
    progress: list[int] = []
    results: list[dict[str, Any]] = []
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            async with (
                open_held_streams(control, client, "first long reply", "second long reply") as streams,
                trio.open_nursery() as nursery,
            ):

                async def drain() -> None:
                    results.append(
                        await admin.call(
                            running.daemon.admin.path, "drain", {}, lambda e: progress.append(e["inflight"])
                        )
                    )

                nursery.start_soon(drain)
                await wait_until(lambda: running.daemon.front.draining and progress == [2])
                during = running.daemon.front.registry.statistics()
                health = await client.get("/health")
                refused = await client.post(CHAT, json=chat("too late"))
                control.set(decoder=DecoderModes())
            after = await client.get("/health")
            drained = running.daemon.front.registry.statistics()
    assert during.draining is True
    assert [(r.endpoint, r.route) for r in during.inflight] == [(CHAT, "plain"), (CHAT, "plain")]
    assert (drained.draining, drained.inflight) == (True, ())
    assert (health.status_code, health.json()["status"]) == (503, "draining")
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "draining"
    assert [streamed_text(s.events) for s in streams] == [
        "first long reply first",
        "second long reply second",
    ]
    assert progress[0] == 2
    assert progress[-1] == 0
    assert results == [{"ok": True, "result": {"drained": True, "kept": 0}}]
    assert after.json()["status"] == "draining"  # until resumed
    assert sorted(line["outcome"] for line in route_lines.lines) == ["error", "ok", "ok"]


async def test_drain_times_out_naming_what_remains_and_resume_takes_requests_again(
    short_dir: Path, control: Control
) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            async with open_held_streams(control, client, "never finishes in time"):
                timed_out = await admin.call(running.daemon.admin.path, "drain", {"timeout": 0.05})
                resumed = await admin.call(running.daemon.admin.path, "resume")
                health = await client.get("/health")
            served = await client.post(CHAT, json=chat("welcome back"))
    assert timed_out["ok"] is False
    assert "1 in flight" in timed_out["error"]
    assert [r["endpoint"] for r in timed_out["remaining"]] == [CHAT]
    assert resumed == {"ok": True, "result": {"draining": False}}
    assert health.json()["status"] == "ok"
    assert served.status_code == 200


async def test_a_bad_drain_timeout_and_an_unknown_verb_get_clear_errors(short_dir: Path, control: Control) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running:
            bad = await admin.call(running.daemon.admin.path, "drain", {"timeout": "soon"})
            unknown = await admin.call(running.daemon.admin.path, "explode")
            draining = running.daemon.front.draining
    assert bad == {"ok": False, "error": "drain: timeout must be a number of seconds >= 0"}
    assert unknown["ok"] is False
    assert "unknown verb 'explode'" in unknown["error"]
    assert draining is False


# -- watch ------------------------------------------------------------------------------------------


async def test_watch_shows_exactly_one_line_per_request_as_it_ends(
    short_dir: Path, control: Control, route_lines: RouteLines
) -> None:
    seen: list[dict[str, Any]] = []
    watching = trio.Event()

    def on_event(event: dict[str, Any]) -> None:
        if event["event"] == "watching":
            watching.set()
        else:
            seen.append(event["line"])

    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(admin.call, running.daemon.admin.path, "watch", {}, on_event)
                await watching.wait()
                await client.post(CHAT, json=chat("one"))
                await client.post(CHAT, content=b"not json")
                await client.post("/completion", json={"prompt": "two", "n_predict": 1})
                await wait_until(lambda: len(seen) == 3)
                nursery.cancel_scope.cancel()
            watchers_left = running.daemon.route_stats.snapshot().watchers
    assert [line["req"] for line in seen] == [line["req"] for line in route_lines.lines]
    assert [line["status"] for line in seen] == [200, 400, 200]
    assert watchers_left <= 1  # the closed watcher is dropped at the next line


# -- reload -----------------------------------------------------------------------------------------


def write_config(path: Path, data: dict[str, Any]) -> None:
    path.write_text(tomli_w.dumps(data))


async def test_reload_applies_live_keys_names_the_rest_and_refuses_a_broken_file(
    short_dir: Path, control: Control
) -> None:
    config = fake_decoder_config(short_dir)
    data = configuration.unstructure(config)
    path = short_dir / "onebit.toml"
    write_config(path, data)
    daemon = Daemon(config, config_path=str(path))
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            started = await nursery.start(daemon.run)
            await daemon.models.default.decoder.wait_state(ChildState.READY)
            async with client_for_url(started.binds[0]) as client:
                data["server"]["api_keys"] = ["sesame"]
                data["model"]["ctx_size"] = 8192
                write_config(path, data)
                applied = await admin.call(daemon.admin.path, "reload")
                locked = await client.post(CHAT, json=chat("hello"))
                opened = await client.post(CHAT, json=chat("hello"), headers={"authorization": "Bearer sesame"})
                path.write_text('[server]\nport = "eighty"\n')
                refused = await admin.call(daemon.admin.path, "reload")
                still = await client.post(CHAT, json=chat("hello"), headers={"authorization": "Bearer sesame"})
            daemon.request_stop()
    assert applied == {"ok": True, "result": {"applied": ["server.api_keys"], "restart_needed": ["model.ctx_size"]}}
    assert locked.status_code == 401
    assert opened.status_code == 200
    assert refused["ok"] is False
    assert refused["lines"] == [f'{path}: server.port: expected int, got "eighty"']
    assert still.status_code == 200
    assert daemon.config.model.ctx_size == config.model.ctx_size


def client_for_url(url: str) -> Any:
    import httpx

    return httpx.AsyncClient(base_url=url, timeout=10)


# -- the admin socket -------------------------------------------------------------------------------


async def test_the_admin_socket_is_not_world_accessible(short_dir: Path, control: Control) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running:
            mode = stat.S_IMODE(os.stat(running.daemon.admin.path).st_mode)
    assert mode == 0o660


async def test_a_missing_daemon_or_a_foreign_socket_gets_a_clear_error(short_dir: Path) -> None:
    foreign = short_dir / "foreign.sock"
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await listener.bind(str(foreign))
    listener.listen(1)

    async def answer_nonsense() -> None:
        conn, _ = await listener.accept()
        with conn:
            await conn.recv(65536)
            await conn.send(b"HTTP/1.1 500 Nope\r\ncontent-length: 0\r\n\r\n")

    with listener, trio.fail_after(TIMEOUT):
        with pytest.raises(AdminUnavailable, match="is onebitd running"):
            await admin.call(short_dir / "absent.sock", "status")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer_nonsense)
            with pytest.raises(AdminUnavailable, match="not an onebitd admin socket"):
                await admin.call(foreign, "status")


# -- sd_notify --------------------------------------------------------------------------------------


async def test_sd_notify_says_ready_status_watchdog_reloading_and_stopping_in_order(
    short_dir: Path, control: Control, monkeypatch: pytest.MonkeyPatch
) -> None:
    address = short_dir / "notify.sock"
    receiver = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    await receiver.bind(str(address))
    # A watchdog of 20 ms: pings every 10 ms, so one arrives while we look.
    monkeypatch.setenv("WATCHDOG_USEC", "20000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    config = fake_decoder_config(short_dir)
    path = short_dir / "onebit.toml"
    write_config(path, configuration.unstructure(config))
    notifier = Notifier(str(address))
    daemon = Daemon(config, config_path=str(path), notifier=notifier)
    messages: list[str] = []

    async def receive_until(word: str) -> None:
        while not any(m.startswith(word) for m in messages):
            messages.append((await receiver.recv(4096)).decode())

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(daemon.run)
            await receive_until("READY=1")
            await receive_until("WATCHDOG=1")
            daemon.reload()
            await receive_until("RELOADING=1")
            daemon.request_stop()
            await receive_until("STOPPING=1")
            await receive_until("STATUS=draining")
    receiver.close()
    notifier.close()
    firsts = [m.split("\n")[0].split("=")[0] for m in messages]
    order = [firsts.index(word) for word in ("READY", "WATCHDOG", "RELOADING", "STOPPING")]
    assert order == sorted(order)
    ready = next(m for m in messages if m.startswith("READY=1"))
    assert "STATUS=serving on http://127.0.0.1:" in ready
    assert re.search(r"RELOADING=1\nMONOTONIC_USEC=\d+", "\n".join(messages))
    assert any(m.startswith("STATUS=draining") for m in messages)


async def test_sd_notify_never_blocks_on_a_receiver_that_stopped_reading(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A receiver that took READY=1 and stopped reading: its queue fills.  A blocking sendto then
    # froze onebitd's whole event loop (the benchmark's onebitd hung at its first STATUS= past the
    # queue's length).  Sent from a thread, so that the old, blocking behaviour fails this test
    # with TooSlowError instead of hanging it.
    caplog.set_level(logging.DEBUG, logger="onebit.notify")
    address = short_dir / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(str(address))
        notifier = Notifier(str(address))

        def flood() -> None:
            for i in range(5000):  # far past any datagram queue's length
                notifier.status(f"status {i}")

        with trio.fail_after(20):
            await trio.to_thread.run_sync(flood, abandon_on_cancel=True)
        assert 0 < len(notifier.sent) < 5000
        assert notifier.dropped == 5000 - len(notifier.sent)
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, "one warning for a run of drops, not one per message"
        # Once the receiver reads again, messages go through and the drops are reported.
        while True:
            try:
                receiver.recv(4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
        notifier.status("after")
        assert notifier.sent[-1] == "STATUS=after"
        assert notifier.dropped == 0
    notifier.close()


def test_sd_notify_is_a_no_op_without_a_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier()
    notifier.ready("serving")
    assert notifier.enabled is False
    assert notifier.sent == []


# -- metrics ----------------------------------------------------------------------------------------


async def test_metrics_count_requests_by_route_and_outcome_and_show_the_children(
    short_dir: Path, control: Control
) -> None:
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            for text in ("one", "two", "three"):
                assert (await client.post(CHAT, json=chat(text))).status_code == 200
            await client.post(CHAT, content=b"not json")
            scraped = await client.get("/metrics")
    assert scraped.status_code == 200
    assert scraped.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(scraped.text)
        for s in family.samples
    }
    assert samples[("onebit_requests_total", (("fallback", "-"), ("outcome", "ok"), ("route", "plain")))] == 3
    assert samples[("onebit_requests_total", (("fallback", "-"), ("outcome", "error"), ("route", "plain")))] == 1
    # Served requests only: the refused one's fast answer is no latency of the service.
    assert samples[("onebit_first_byte_seconds_count", (("route", "plain"),))] == 3
    assert samples[("onebit_decoder_prompt_tokens_total", (("route", "plain"),))] > 0
    assert samples[("onebit_child_state", (("child", "decoder"), ("state", "ready")))] == 1
    assert samples[("onebit_child_restarts_total", (("child", "decoder"),))] == 0
    assert samples[("onebit_slots", ())] == 2
    assert samples[("onebit_draining", ())] == 0


def onebits_families(text: str) -> str:
    """onebitd's own families of a /metrics answer (the decoder's ``llamacpp:*`` follow them)."""
    kept = []
    for line in text.splitlines():
        name = line.split(" ", 3)[2] if line.startswith(("# HELP ", "# TYPE ")) else line
        if name.startswith("onebit_"):
            kept.append(line)
    return "\n".join(kept) + "\n"


async def test_metrics_pass_promtool_check(short_dir: Path, control: Control) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.geteuid() == 0:
            pytest.fail("no promtool: run scripts/setup (it installs Debian's prometheus package as root)")
        pytest.skip("no promtool, and not root to install it: sudo apt-get install prometheus")
    config = fake_decoder_config(short_dir, cache={"enabled": True})
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, client_for(running) as client:
            assert (await client.post(CHAT, json=chat("one"))).status_code == 200
            await client.post(CHAT, content=b"not json")
            scraped = await client.get("/metrics")
    ours = onebits_families(scraped.text)
    assert "onebit_requests_total" in ours
    assert "onebit_prefix_store_restore_seconds_total" in ours
    with trio.fail_after(TIMEOUT):
        done = await trio.run_process(
            [promtool, "check", "metrics"], stdin=ours.encode(), capture_stdout=True, capture_stderr=True, check=False
        )
    assert done.returncode == 0, (done.stdout + done.stderr).decode()


# -- the systemd unit -------------------------------------------------------------------------------


def unit_for_here(tmp_path: Path) -> Path:
    """The shipped unit with ExecStart pointing at this checkout (verify wants the binary to exist)."""
    text = (ROOT / "systemd" / "onebitd.service").read_text()
    here = shutil.which("onebitd") or str(ROOT / ".venv" / "bin" / "onebitd")
    unit = tmp_path / "onebitd.service"
    unit.write_text(text.replace("/opt/onebit/.venv/bin/onebitd", here))
    return unit


def test_the_systemd_unit_verifies(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    assert tool is not None, "systemd-analyze is needed (Debian package systemd)"
    unit = unit_for_here(tmp_path)
    done = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    text = unit.read_text()
    for needed in ("Type=notify", "WatchdogSec=", "ExecReload=", "KillMode=mixed", "RuntimeDirectory=onebit"):
        assert needed in text


def test_the_systemd_unit_scores_ok_or_better_and_docs_record_the_score(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    assert tool is not None, "systemd-analyze is needed (Debian package systemd)"
    done = subprocess.run(
        [tool, "security", "--offline=yes", str(unit_for_here(tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    found = re.search(r"Overall exposure level for onebitd.service: (\d+\.\d+)", done.stdout)
    assert found is not None, done.stdout[-2000:] + done.stderr
    score = float(found.group(1))
    assert score < 4.0
    assert f"exposure level {score}" in (ROOT / "docs" / "operations.md").read_text()


def test_every_config_file_in_config_loads() -> None:
    files = sorted((ROOT / "config").glob("*.toml"))
    assert files
    for path in files:
        configuration.load(path)
    assert json.dumps(configuration.unstructure(configuration.load(ROOT / "config" / "onebit.toml")))


# -- the runtime directory --------------------------------------------------------------------------


async def test_leftovers_of_a_crashed_daemon_are_removed_at_start(short_dir: Path, control: Control) -> None:
    state = short_dir / "state"
    state.mkdir()
    (state / "dead-request.state").write_bytes(b"stale")
    (short_dir / "share-dead-1.sock").write_bytes(b"")
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)):
            left = os.listdir(state) + [n for n in os.listdir(short_dir) if n.startswith("share-")]
    assert left == []


async def test_a_second_daemon_on_the_same_runtime_directory_is_refused(short_dir: Path, control: Control) -> None:
    config = fake_decoder_config(short_dir)
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running:
            second = Daemon(config)
            with pytest.RaisesGroup(pytest.RaisesExc(RuntimeDirInUse, match=f"pid {os.getpid()}")):
                async with trio.open_nursery() as nursery:
                    await nursery.start(second.run)
            assert running.daemon.admin.path.exists()
