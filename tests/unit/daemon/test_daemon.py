"""The daemon's root: what it says when it cannot start, and what it leaves behind when it stops."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomli_w
import trio
import trio.testing

from supervisor import config as configuration
from supervisor.daemon import Daemon, leaves, local_url
from supervisor.errors import ConfigError, ListenError, RuntimeDirInUse
from supervisor.supervise.child import ChildState
from tests.fakes import fake_provider
from tests.rigs.helpers import wait_until
from tests.rigs.rig import Control, ProviderModes, child_of, fake_decoder_config, run_daemon, several

TIMEOUT = 30
ROOT = Path(__file__).parents[3]


def onebitd(config_file: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.daemon", "--config", str(config_file)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
        cwd=ROOT,
    )


def test_a_port_in_use_is_one_line_naming_the_file_and_server_port_and_no_child_starts(
    short_dir: Path, control: Control
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        data = configuration.unstructure(fake_decoder_config(short_dir))
        data["server"]["port"] = port
        path = short_dir / "second.toml"
        path.write_text(tomli_w.dumps(data))
        done = onebitd(path)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1:] == [
        f"onebitd: {path}: server.port: cannot listen on 127.0.0.1 port {port}: Address already in use"
    ]
    assert "Exceptions from Trio nursery" not in done.stderr
    assert control.events("decoder", "start") == []
    assert not (short_dir / "onebitd.lock").exists()


def test_leaves_unwraps_nested_exception_groups() -> None:
    inner = ListenError("server.port: in use")
    nested = ExceptionGroup("outer", [ExceptionGroup("inner", [inner]), ValueError("x")])
    assert [str(leaf) for leaf in leaves(nested)] == ["server.port: in use", "x"]


async def test_a_second_daemon_is_refused_naming_server_runtime_dir(short_dir: Path, control: Control) -> None:
    config = fake_decoder_config(short_dir)
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config):
            second = Daemon(config)
            with pytest.RaisesGroup(pytest.RaisesExc(RuntimeDirInUse)) as caught:
                async with trio.open_nursery() as nursery:
                    await nursery.start(second.run)
    message = str(caught.value.exceptions[0])
    assert message.startswith(f"server.runtime_dir: another onebitd (pid {os.getpid()}) is using {short_dir}")


async def test_a_clean_stop_removes_the_sockets_and_the_lock_it_made_and_nothing_else(
    short_dir: Path, control: Control
) -> None:
    # A llama-server provider (the fake decoder again) has a socket of its own in the directory.
    config = fake_decoder_config(short_dir, provider=[{"kind": "llama-server", "name": "p0"}])
    mine = short_dir / "operator-notes.txt"
    mine.write_text("not onebitd's")
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running:
            provider = running.daemon.models.default.parts.providers.all[0]
            await child_of(provider).wait_state(ChildState.READY)
            made = {"decoder.sock", "provider-p0.sock", "onebitd.lock", "admin.sock"}
            assert made <= set(os.listdir(short_dir))
    assert made.isdisjoint(os.listdir(short_dir))
    assert mine.read_text() == "not onebitd's"


# -- readiness: the decoder, and every provider's first start ----------------------------------------


def worker(command: list[str]) -> dict[str, object]:
    return {"kind": "worker", "name": "npu0", "command": command, "fidelity_check": False}


async def test_health_says_loading_until_a_providers_first_start_is_over_then_ok(
    short_dir: Path, control: Control
) -> None:
    control.set(provider=ProviderModes(ready_on_signal=True))
    config = fake_decoder_config(
        short_dir,
        hybrid={"enabled": True},
        provider=[worker([sys.executable, str(fake_provider.PATH), "--worker"])],
    )
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, httpx.AsyncClient(base_url=running.url, timeout=TIMEOUT) as client:
            await wait_until(lambda: bool(control.events("provider", "waiting")))
            loading = await client.get("/health")
            status = running.daemon.state()
            ready_early = running.daemon.ready.is_set()
            pid = child_of(running.daemon.models.default.parts.providers.all[0]).pid
            assert pid is not None
            os.kill(pid, signal.SIGUSR1)
            await running.daemon.ready.wait()
            ok = await client.get("/health")
    assert loading.status_code == 503
    assert loading.json() == {"status": "loading", "providers_not_ready": ["npu0"]}
    assert status == "loading"
    assert not ready_early
    assert ok.status_code == 200
    assert ok.json() == {"status": "ok"}


@pytest.mark.parametrize("models", [1, 2], ids=["one_model", "several_models"])
async def test_a_llama_server_provider_slower_to_start_than_the_decoder_is_waited_for_not_called_failed(
    short_dir: Path, control: Control, caplog: pytest.LogCaptureFixture, models: int
) -> None:
    caplog.set_level(logging.INFO, logger="onebit.daemon")
    # The provider (the fake decoder again, through a wrapper: another binary than the decoder's, so
    # no start-time check here, which the fake cannot answer) loads its model only once the test
    # says so; the decoder at once.
    go = short_dir / "provider-go"
    slow = short_dir / "slow-llama-server"
    launcher = short_dir / "fake-llama-server"
    slow.write_text(f'#!/bin/sh\nwhile [ ! -e {go} ]; do sleep 0.01; done\nexec {launcher} "$@"\n')
    slow.chmod(0o755)
    hybrid: dict[str, Any] = {
        "hybrid": {"enabled": True},
        "provider": [{"kind": "llama-server", "name": "p0", "binary": str(slow)}],
    }
    # Several models: the default's load is over when its decoder is healthy, its provider still starts.
    one = fake_decoder_config(short_dir, **hybrid) if models == 1 else None
    config = one or several(short_dir, ["a", "b"], sections=hybrid)
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config, wait_ready=False, check_fidelity=False) as running:
            provider = running.daemon.models.default.parts.providers.all[0]
            await running.daemon.models.default.decoder.wait_state(ChildState.READY)
            await running.daemon.models.settled.wait()
            await trio.testing.wait_all_tasks_blocked()
            ready_early = running.daemon.ready.is_set()
            go.touch()
            await running.daemon.ready.wait()
            ready = provider.ready
    assert not ready_early
    assert ready
    errors = [r.getMessage() for r in caplog.records if r.name == "onebit.daemon" and r.levelno >= logging.WARNING]
    assert errors == []


async def test_a_provider_that_failed_its_start_is_named_by_health_and_the_log(
    short_dir: Path, control: Control, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="onebit.daemon")
    config = fake_decoder_config(
        short_dir, hybrid={"enabled": True}, provider=[worker([sys.executable, "-c", "raise SystemExit(3)"])]
    )
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, httpx.AsyncClient(base_url=running.url, timeout=TIMEOUT) as client:
            await running.daemon.ready.wait()
            ok = await client.get("/health")
    assert ok.status_code == 200
    assert ok.json() == {"status": "ok", "providers_not_ready": ["npu0"]}
    errors = [r.getMessage() for r in caplog.records if r.name == "onebit.daemon" and r.levelno == logging.ERROR]
    assert errors == ["provider npu0 is not ready (exit status 3): requests take the plain route until it is"]


def test_a_refused_reload_is_logged_by_the_daemon_whoever_asked(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # onebitctl reload (the admin verb) and SIGHUP both call Daemon.reload: the log says why, once.
    path = short_dir / "onebit.toml"
    path.write_text(tomli_w.dumps(configuration.unstructure(fake_decoder_config(short_dir))))
    daemon = Daemon(configuration.load(path), config_path=str(path))
    path.write_text('[server]\nport = "eighty"\n')
    caplog.set_level(logging.INFO, logger="onebit.daemon")
    with pytest.raises(ConfigError):
        daemon.reload()
    errors = [r.getMessage() for r in caplog.records if r.name == "onebit.daemon" and r.levelno == logging.ERROR]
    assert errors == [f'reload refused: {path}: server.port: expected int, got "eighty"']


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:18080"),
        ("0.0.0.0", "http://127.0.0.1:18080"),
        ("::1", "http://[::1]:18080"),
        ("::", "http://[::1]:18080"),
    ],
)
def test_scripts_run_names_the_address_its_config_binds(host: str, url: str) -> None:
    config = configuration.loads(f'[server]\nhost = "{host}"\nport = 18080\n', "mine.toml")
    assert local_url(config) == url
    script = (ROOT / "scripts" / "run").read_text()
    assert "daemon.local_url(" in script
    assert "on http://127.0.0.1:8080" not in script


def test_the_readme_shows_onebitd_with_a_config_file() -> None:
    assert "onebitd --config " in (ROOT / "README.md").read_text()
