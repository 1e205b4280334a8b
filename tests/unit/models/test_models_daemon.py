"""Several models with the fake decoder, for what the real one cannot be made to do: a model that
does not load in time, a reload that adds and removes models while the others run on, and a
provider two models name restarted for the one that asks while that one's requests go plain."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomli_w
import trio

from supervisor import config as configuration
from supervisor.admin import render
from supervisor.daemon import Daemon
from supervisor.models.model import ModelState
from supervisor.observe.status import from_wire, to_wire
from supervisor.providers.seat import Tenant
from tests.fakes import fake_provider
from tests.rigs.helpers import gone, reaped, wait_until
from tests.rigs.rig import (
    HANDOFF_ALWAYS,
    Control,
    DecoderModes,
    ProviderModes,
    RouteLines,
    fake_decoder_config,
    make_config,
    run_daemon,
    several,
)

TIMEOUT = 30


async def test_a_model_that_does_not_load_in_time_is_a_503_with_retry_after(
    short_dir: Path, control: Control, route_lines: RouteLines
) -> None:
    config = several(short_dir, ["a", "b"], load_timeout_s=0.5)
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, httpx.AsyncClient(base_url=running.url, timeout=TIMEOUT) as client:
            control.set(decoder=DecoderModes(exit=1))  # every decoder started from now on crashes at once
            reply = await client.post("/completion", json={"model": "b", "prompt": "hello there", "n_predict": 2})
            assert reply.status_code == 503
            assert reply.headers["retry-after"] == "1"
            assert "model b" in reply.json()["error"]["message"]
            (line,) = await route_lines.until(1)
            assert (line["model"], line["status"], line["outcome"]) == ("b", 503, "error")
            assert line["load_ms"] > 0
            control.set(decoder=DecoderModes())
            ok = await client.post("/completion", json={"model": "a", "prompt": "hello there", "n_predict": 2})
            assert ok.status_code == 200


async def test_a_reload_adds_and_removes_models_and_leaves_the_others_running(
    short_dir: Path, control: Control
) -> None:
    config = several(short_dir, ["a", "b"])
    path = short_dir / "onebit.toml"
    path.write_text(tomli_w.dumps(configuration.unstructure(config)))
    daemon = Daemon(configuration.load(path), config_path=str(path))
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            started = await nursery.start(daemon.run)
            try:
                async with httpx.AsyncClient(base_url=started.binds[0]) as client:
                    body = {"prompt": "hello there", "n_predict": 2}
                    assert (await client.post("/completion", json={**body, "model": "b"})).status_code == 200
                    a = daemon.models.get("a")
                    assert a is not None
                    pid = a.decoder.pid
                    changed = several(short_dir, ["a", "c"])
                    path.write_text(tomli_w.dumps(configuration.unstructure(changed)))
                    done = daemon.reload()
                    assert done["applied"] == ["model[c]", "model[b]"]
                    assert daemon.models.get("b") is None
                    listing = (await client.get("/v1/models")).json()
                    assert [entry["id"] for entry in listing["data"]] == ["a", "c"]
                    assert (await client.post("/completion", json={**body, "model": "c"})).status_code == 200
                    refused = await client.post("/completion", json={**body, "model": "b"})
                    assert refused.status_code == 404
                    assert a.decoder.pid == pid
                    assert a.state is ModelState.LOADED
            finally:
                daemon.request_stop()


async def test_with_one_model_a_request_may_name_any_model_as_llama_server_allows(
    short_dir: Path, control: Control, route_lines: RouteLines
) -> None:
    with trio.fail_after(TIMEOUT):
        async with (
            run_daemon(fake_decoder_config(short_dir)) as running,
            httpx.AsyncClient(base_url=running.url, timeout=TIMEOUT) as client,
        ):
            reply = await client.post("/completion", json={"model": "gpt-4", "prompt": "hello there", "n_predict": 2})
            assert reply.status_code == 200
            (line,) = await route_lines.until(1)
            assert (line["model"], line["load_ms"]) == ("fake", None)


async def test_a_mixed_burst_is_served_with_one_swap_the_loaded_models_requests_first(
    short_dir: Path, control: Control
) -> None:
    config = several(short_dir, ["a", "b"], max_loaded=1)
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, httpx.AsyncClient(base_url=running.url, timeout=TIMEOUT) as client:
            models = running.daemon.models
            a, b = models.get("a"), models.get("b")
            assert a is not None
            assert b is not None
            await a.wait_state(ModelState.LOADED)
            control.set(decoder=DecoderModes(hold=True))  # a's requests stay in its decoder meanwhile
            statuses: list[int] = []

            async def one(name: str) -> None:
                reply = await client.post("/completion", json={"model": name, "prompt": "hello there", "n_predict": 2})
                statuses.append(reply.status_code)

            async with trio.open_nursery() as nursery:
                # a's first: a b arriving while a is idle would swap at once, which is right but
                # not this test.  The client's connections race, so the first is let in alone.
                nursery.start_soon(one, "a")
                await wait_until(lambda: a.users == 1)
                for name in ["b", "a", "b", "a", "b"]:
                    nursery.start_soon(one, name)
                # Every request arrived: b's wait for a, which is busy with its own.
                await wait_until(lambda: a.users == 3 and models.statistics().waiting == 3)
                assert b.state is ModelState.UNLOADED
                control.set(decoder=DecoderModes())
            assert statuses == [200] * 6
            assert (a.loads, b.loads, models.swaps) == (1, 1, 1)
            metrics = (await client.get("/metrics")).text
            assert 'onebit_model_state{model="b",state="loaded"} 1.0' in metrics
            assert 'onebit_model_loads_total{model="b"} 1.0' in metrics
            assert "onebit_model_swaps_total 1.0" in metrics
            assert 'onebit_model_requests_total{model="a",outcome="ok"} 3.0' in metrics
            assert 'onebit_model_slots_busy{model="b"} 0.0' in metrics
            # onebitctl status: a table of the models, read back from the wire as onebitctl reads it.
            table = render.render_status(from_wire(to_wire(running.daemon.statistics())))
            rows = {line.split()[0]: line.split() for line in table.splitlines() if line.startswith(("a ", "b "))}
            assert rows["a"][1:3] == ["(default)", "unloaded"]
            assert rows["b"][1] == "loaded"
            assert rows["b"][5] == "0/2"  # its slots: none busy of 2
            assert "1 swaps; 0 waiting for a load" in table


async def test_a_model_waiting_past_its_bound_holds_new_requests_for_the_one_in_its_way(
    short_dir: Path, control: Control, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("supervisor.models.registry.STARVE_S", 0.2)
    config = several(short_dir, ["a", "b"], max_loaded=1)
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, httpx.AsyncClient(base_url=running.url, timeout=TIMEOUT) as client:
            models = running.daemon.models
            a = models.get("a")
            assert a is not None
            await a.wait_state(ModelState.LOADED)
            control.set(decoder=DecoderModes(hold=True))
            answered: list[tuple[str, int]] = []

            async def one(name: str) -> None:
                reply = await client.post("/completion", json={"model": name, "prompt": "hello there", "n_predict": 2})
                answered.append((name, reply.status_code))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, "a")  # held in a's decoder: a stays in use
                await wait_until(lambda: a.users == 1)
                nursery.start_soon(one, "b")
                await wait_until(lambda: models.statistics().waiting == 1)
                began = trio.current_time()
                await wait_until(lambda: trio.current_time() - began > 0.2)  # b starves
                nursery.start_soon(one, "a")  # waits behind b, though a is loaded
                await wait_until(lambda: models.statistics().waiting == 2)
                assert a.users == 1
                control.set(decoder=DecoderModes())
            assert answered == [("a", 200), ("b", 200), ("a", 200)]
            assert models.swaps == 2


async def test_one_model_unloaded_by_onebitctl_is_loaded_again_by_the_next_request(
    short_dir: Path, control: Control, route_lines: RouteLines
) -> None:
    with trio.fail_after(TIMEOUT):
        async with (
            run_daemon(fake_decoder_config(short_dir)) as running,
            httpx.AsyncClient(base_url=running.url, timeout=TIMEOUT) as client,
        ):
            await running.daemon.models.default.wait_state(ModelState.LOADED)
            unloaded = await running.daemon.unload("fake")
            assert unloaded.state == "unloaded"
            reply = await client.post("/completion", json={"prompt": "hello there", "n_predict": 2})
            assert reply.status_code == 200
            (line,) = await route_lines.until(1)
            assert line["load_ms"] > 0
            assert running.daemon.models.default.loads == 2


async def test_one_model_idle_past_its_ttl_is_loaded_again_by_the_next_request_and_let_go_after_each(
    short_dir: Path, control: Control, route_lines: RouteLines
) -> None:
    # Not loaded at start: the first request loads it, as the next one does once it went idle.
    config = fake_decoder_config(short_dir, model={"ttl_s": 0.2, "preload": False})
    with trio.fail_after(TIMEOUT):
        async with (
            run_daemon(config, wait_ready=False) as running,
            httpx.AsyncClient(base_url=running.url, timeout=TIMEOUT) as client,
        ):
            model = running.daemon.models.default
            for n in (1, 2):
                reply = await client.post("/completion", json={"prompt": "hello there", "n_predict": 2})
                assert reply.status_code == 200
                line = (await route_lines.until(n))[n - 1]
                assert line["load_ms"] > 0
                assert model.loads == n
                while model.state is not ModelState.UNLOADED:  # idle past its ttl_s
                    await model.wait_changed()
            refused = await client.post("/completion", json={"prompt": "hello there", "n_predict": "two"})
            assert refused.status_code == 400
            await route_lines.until(3)
            assert model.loads == 3
            assert model.users == 0  # held by each request, let go whether it ended well or not


async def test_a_preloaded_model_with_a_ttl_is_loaded_and_idle_from_then_not_from_before_its_load(
    short_dir: Path, control: Control
) -> None:
    # Preloaded (the default) and never asked for: its ttl_s counts from the end of its load.
    config = fake_decoder_config(short_dir, model={"ttl_s": 0.2})
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config, wait_ready=False) as running:
            model = running.daemon.models.default
            await model.wait_state(ModelState.LOADED)
            assert model.loads == 1
            await model.wait_state(ModelState.UNLOADED)  # then idle past its ttl_s
    assert model.loads == 1


def left_in(runtime: Path) -> list[str]:
    """Files in the models' runtime directories (sockets, state files) once onebitd stopped."""
    return sorted(str(p.relative_to(runtime)) for p in runtime.glob("model-*/**/*") if not p.is_dir())


def tenant_of(running: Any, name: str) -> Tenant:
    model = running.daemon.models.get(name)
    assert model is not None
    (tenant,) = model.parts.providers.all
    assert isinstance(tenant, Tenant)
    return tenant


async def test_a_provider_two_models_name_is_restarted_for_the_other_which_goes_plain_meanwhile(
    short_dir: Path, control: Control, route_lines: RouteLines
) -> None:
    command = [sys.executable, str(fake_provider.PATH), "--worker"]
    worker = {"kind": "worker", "name": "npu0", "command": command, "fidelity_check": False}
    base = several(short_dir, ["a", "b"], table={"providers": ["npu0"]})
    config = make_config(
        short_dir,
        decoder=configuration.unstructure(base)["decoder"],
        model=configuration.unstructure(base)["model"],
        hybrid={"enabled": True, "mode": "file", "min_prompt_tokens": 4, **HANDOFF_ALWAYS},
        provider=[worker],
    )
    body = {"prompt": "the quick brown fox jumps over the lazy dog", "n_predict": 2}
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, httpx.AsyncClient(base_url=running.url) as client:
            a = tenant_of(running, "a")
            await wait_until(lambda: a.ready)
            assert (await client.post("/completion", json={"model": "a", **body})).status_code == 200
            (first_pid,) = [event["pid"] for event in control.events("provider", "start")]
            # b's worker will hold its ready line: b's requests go plain while it starts.
            control.set(provider=ProviderModes(ready_on_signal=True))
            assert (await client.post("/completion", json={"model": "b", **body})).status_code == 200
            b = tenant_of(running, "b")
            await wait_until(lambda: bool(control.events("provider", "waiting")))
            assert gone(first_pid)  # a's process stopped before b's started
            assert (await client.post("/completion", json={"model": "b", **body})).status_code == 200
            (waiting,) = control.events("provider", "waiting")
            os.kill(waiting["pid"], signal.SIGUSR1)
            await wait_until(lambda: b.ready)
            assert not a.ready
            assert (await client.post("/completion", json={"model": "b", **body})).status_code == 200
            lines = await route_lines.until(4)
            assert [(line["model"], line["route"], line.get("fallback")) for line in lines] == [
                ("a", "file", None),
                ("b", "plain", "provider-swapping"),  # the handover it asked for
                ("b", "plain", "provider-swapping"),  # b's worker starting
                ("b", "file", None),
            ]
            # Each job went to a process started with its own model's parameters.
            jobs = control.events("provider", "job")
            assert [(event["job"]["model"], event["pid"] == first_pid) for event in jobs] == [("a", True), ("b", False)]
            assert a.seat.swaps == 1
            # Each model's providers and prefix store, in /metrics (labelled model) and onebitctl status.
            metrics = (await client.get("/metrics")).text
            where = 'device="-",engine="-",kind="worker"'
            assert f'onebit_provider_ready{{{where},model="a",provider="npu0"}} 0.0' in metrics
            assert f'onebit_provider_ready{{{where},model="b",provider="npu0"}} 1.0' in metrics
            assert f'onebit_provider_jobs_total{{{where},model="b",provider="npu0"}} 1.0' in metrics
            assert 'onebit_prefix_store_enabled{model="a"} 1.0' in metrics
            assert 'onebit_prefix_store_enabled{model="b"} 1.0' in metrics
            table = render.render_status(from_wire(to_wire(running.daemon.statistics())))
            rows = [line.split() for line in table.splitlines() if line.split()[1:2] == ["npu0"]]
            assert [(row[0], row[5]) for row in rows] == [("a", "no"), ("b", "yes")]
            assert sum(line.startswith(("prefix store a: ", "prefix store b: ")) for line in table.splitlines()) == 2
        # Both workers reaped, and neither model's provider socket or state file left behind.
        assert [reaped(event["pid"]) for event in control.events("provider", "start")] == [True, True]
        assert not left_in(short_dir)
