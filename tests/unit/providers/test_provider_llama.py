"""The llama-server provider's engine and start gate, against tests/fakes/llama/process.py in a wrapper that
answers ``--list-devices`` as an OpenVINO llama-server does: the device it resolves, the variables and
slots it starts with, and a refusal (a missing device, a gate's verdict) that stops only it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import cast

import attrs
import pytest
import trio

from supervisor.config import Config, LlamaServerProviderConfig, RestartPolicy, modelspec
from supervisor.config.live import Settings
from supervisor.llama import openvino
from supervisor.llama.region import Written
from supervisor.models.layout import Layout
from supervisor.models.model import Model
from supervisor.providers import Claim, PrefillJob, Provider, ProviderStatistics, ShareJob
from supervisor.providers import llama as llama_provider
from supervisor.providers.base import Checked, Gate
from supervisor.providers.llama import LlamaServerProvider
from supervisor.routes.capability import Restores
from supervisor.routes.file import FileHandoff
from supervisor.supervise.child import ChildState
from tests.rigs.helpers import reaped, wait_until
from tests.rigs.rig import FAKE_LLAMA_EXEC, fake_decoder_config, run_daemon
from tests.unit.routes.test_fidelity import FakeDecoder, FakeHandoff

DEVICES = (
    "Available devices:\n"
    "  OPENVINO0: GGML_OPENVINO_DEVICE=CPU (selected) - Test CPU (1000 MiB, 900 MiB free)\n"
    "  OPENVINO1: GGML_OPENVINO_DEVICE=NPU - Test NPU (0 MiB, 0 MiB free)\n"
)


def openvino_binary(directory: Path, *, crashes: bool = False) -> Path:
    """A fake OpenVINO llama-server: the device list, else the fake decoder with its env noted
    (``crashes``: else it dies of SIGSEGV, as the backend does loading a model it cannot take)."""
    (directory / "devices.txt").write_text(DEVICES)
    script = directory / "ov-llama-server"
    script.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" --list-devices "*) cat '
        + str(directory / "devices.txt")
        + "; exit 0;; esac\n"
        + ("kill -SEGV $$\n" if crashes else "")
        + "env | grep '^GGML_OPENVINO_' | sort > "
        + str(directory / "ov-env.txt")
        + "\n"
        + FAKE_LLAMA_EXEC
        + "\n"
    )
    script.chmod(0o755)
    return script


def provider_for(
    short_dir: Path, *, device: str = "auto", gate: Gate | None = None
) -> tuple[LlamaServerProvider, Config]:
    config = fake_decoder_config(short_dir, model={"parallel": 4}, cache={"compile_dir": str(short_dir / "ov")})
    spec = LlamaServerProviderConfig(
        name="ov", engine="openvino", device=device, binary=str(openvino_binary(short_dir)), threads=1
    )
    provider = LlamaServerProvider(
        spec, config, runtime_dir=short_dir, state_dir=short_dir / "state", kv_unified=True, gate=gate
    )
    return provider, config


@pytest.mark.usefixtures("control")
async def test_auto_resolves_to_the_npu_which_starts_on_one_slot_with_its_device_and_compile_cache(
    short_dir: Path,
) -> None:
    provider, _ = provider_for(short_dir)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(provider.run)
            await wait_until(lambda: provider.ready)
            argv = list(provider.launcher.argv())
            stats = provider.statistics()
            nursery.cancel_scope.cancel()
    assert (stats.engine, stats.device, stats.refused) == ("openvino", "NPU", None)
    assert provider.static
    assert argv[argv.index("-np") + 1] == "1"
    assert "--kv-unified" in argv
    assert provider.slots.n_slots == 1
    env = dict(line.split("=", 1) for line in (short_dir / "ov-env.txt").read_text().splitlines())
    assert env == {
        "GGML_OPENVINO_CACHE_DIR": str(short_dir / "ov" / "plugin"),
        "GGML_OPENVINO_COMPILED_MODEL_CACHE_DIR": str(short_dir / "ov" / "compiled"),
        "GGML_OPENVINO_DEVICE": "NPU",
    }


@pytest.mark.usefixtures("control")
async def test_a_named_cpu_device_keeps_the_models_slots(short_dir: Path) -> None:
    provider, _ = provider_for(short_dir, device="CPU")
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(provider.run)
            await wait_until(lambda: provider.ready)
            argv = list(provider.launcher.argv())
            nursery.cancel_scope.cancel()
    assert provider.device == "CPU"
    assert not provider.static
    assert argv[argv.index("-np") + 1] == "4"


@pytest.mark.usefixtures("control")
async def test_a_device_the_runtime_does_not_list_is_refused_in_one_line_and_nothing_starts(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="onebit.provider")
    provider, _ = provider_for(short_dir, device="GPU")
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(provider.run)
            await wait_until(lambda: provider.refused is not None)
            nursery.cancel_scope.cancel()
    assert not provider.ready
    assert provider.child.state is ChildState.STOPPED
    assert provider.refused == "device GPU is not among the runtime's devices (CPU, NPU)"
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert line == "provider ov: refused for this model, the other providers go on: " + provider.refused
    assert not (short_dir / "ov-env.txt").exists()


@pytest.mark.usefixtures("control")
async def test_a_provider_its_gate_refuses_takes_no_job_and_its_server_is_stopped(short_dir: Path) -> None:
    asked: list[int | None] = []

    async def too_far(provider: Provider) -> Checked:
        assert provider.child is not None
        asked.append(provider.child.pid)
        await trio.lowlevel.checkpoint()
        return Checked(refused="next-token TV distance 0.4: over the bound")

    provider, _ = provider_for(short_dir, device="CPU", gate=too_far)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(provider.run)
            await wait_until(lambda: provider.refused is not None)
            await wait_until(lambda: provider.child.state is ChildState.STOPPED)
            nursery.cancel_scope.cancel()
    (pid,) = asked
    assert pid is not None
    assert reaped(pid)
    stats = provider.statistics()
    assert (stats.ready, stats.refused) == (False, "next-token TV distance 0.4: over the bound")


@pytest.mark.usefixtures("control")
async def test_a_provider_is_not_ready_until_its_gate_admits_it(short_dir: Path) -> None:
    admit = trio.Event()
    seen_ready: list[bool] = []

    async def slow(provider: Provider) -> Checked:
        seen_ready.append(provider.ready)
        await admit.wait()
        return Checked()

    provider, _ = provider_for(short_dir, device="CPU", gate=slow)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(provider.run)
            await wait_until(lambda: bool(seen_ready))
            assert provider.child.state is ChildState.READY
            assert not provider.ready
            admit.set()
            await wait_until(lambda: provider.ready)
            nursery.cancel_scope.cancel()
    assert seen_ready == [False]


def openvino_config(short_dir: Path, device: str) -> Config:
    """A model on four slots with one OpenVINO provider ``ov`` on ``device``, the fake runtime's."""
    binary = openvino_binary(short_dir)
    return fake_decoder_config(
        short_dir,
        model={"parallel": 4},
        cache={"compile_dir": str(short_dir / "ov")},
        provider=[
            {"kind": "llama-server", "name": "ov", "engine": "openvino", "device": device, "binary": str(binary)}
        ],
    )


@pytest.mark.parametrize(("device", "unified"), [("auto", True), ("CPU", False)])
@pytest.mark.usefixtures("control")
async def test_the_daemon_asks_for_devices_before_the_decoder_starts_and_unifies_every_kv_for_an_npu(
    short_dir: Path, device: str, unified: bool
) -> None:
    config = openvino_config(short_dir, device)
    with trio.fail_after(30):
        async with run_daemon(config) as running:
            (provider,) = running.daemon.models.default.parts.providers.all
            assert isinstance(provider, LlamaServerProvider)
            await wait_until(lambda: provider.ready)
            decoder_argv = list(running.daemon.models.default.parts.launcher.argv())
            provider_argv = list(provider.launcher.argv())
            store = running.daemon.models.default.store
            assert store is not None
            fingerprint = store.fingerprint
    assert provider.device == ("NPU" if unified else "CPU")
    assert ("--kv-unified" in decoder_argv) is unified
    assert ("--kv-unified" in provider_argv) is unified
    assert decoder_argv[decoder_argv.index("-np") + 1] == "4"
    assert provider_argv[provider_argv.index("-np") + 1] == ("1" if unified else "4")
    assert fingerprint is not None
    assert fingerprint.engines == (("ov=openvino/NPU/static",) if unified else ("ov=openvino/CPU",))
    assert fingerprint.kv_unified is unified


@pytest.mark.usefixtures("control")
async def test_a_models_layout_is_chosen_before_its_first_start_and_every_load_is_built_whole_from_it(
    short_dir: Path,
) -> None:
    """The devices asked once; the load's parts built from the layout, not patched after: every
    launcher takes ``--kv-unified`` as it is made, the provider its device and one slot, and a later
    load's provider has its device without asking the runtime again."""
    config = openvino_config(short_dir, "auto")
    (spec,) = modelspec.specs(config)
    model = Model(spec, runtime_dir=short_dir, settings=Settings(config), check_fidelity=False)
    asking = model.parts
    with trio.fail_after(30):
        await model.choose_layout()
    assert model.layout == Layout(kv_unified=True, devices={"ov": "NPU"})
    first = model.parts
    model.fresh_parts()  # after an unload: the next load's parts
    for parts in (first, model.parts):
        assert parts is not asking
        (provider,) = parts.llama_providers()
        assert (provider.device, provider.parallel, provider.static) == ("NPU", 1, True)
        assert "--kv-unified" in parts.launcher.argv()
        assert "--kv-unified" in provider.launcher.argv()


def auto_provider(
    short_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    device: str,
    gate: Gate | None = None,
    crashes: bool = False,
) -> LlamaServerProvider:
    monkeypatch.setenv(openvino.BINARY_ENV, str(openvino_binary(short_dir, crashes=crashes)))
    config = fake_decoder_config(short_dir, model={"parallel": 4}, cache={"compile_dir": str(short_dir / "ov")})
    restart = RestartPolicy(backoff_initial_s=0, backoff_max_s=0, max_failures=2)
    spec = LlamaServerProviderConfig(name="ov", engine="auto", device=device, threads=1, restart=restart)
    return LlamaServerProvider(spec, config, runtime_dir=short_dir, state_dir=short_dir / "state", gate=gate)


async def ready_statistics(provider: LlamaServerProvider) -> ProviderStatistics:
    """``provider`` run until it takes jobs, on whichever engine it went on with: its statistics then."""
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(provider.run)
            await wait_until(lambda: provider.ready)
            stats = provider.statistics()
            nursery.cancel_scope.cancel()
    return stats


@pytest.mark.usefixtures("control")
async def test_engine_auto_goes_on_with_ggml_when_the_openvino_runtime_lacks_the_device(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="onebit.provider")
    provider = auto_provider(short_dir, monkeypatch, device="GPU")
    assert provider.engine == "openvino"
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(provider.run)
            await wait_until(lambda: provider.ready)
            argv = list(provider.launcher.argv())
            nursery.cancel_scope.cancel()
    assert (provider.engine, provider.device, provider.refused) == ("ggml", "CPU", None)
    assert argv[0] != str(short_dir / "ov-llama-server")
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert line.startswith("ov: engine auto: OpenVINO refused (device GPU is not among the runtime's devices")
    assert line.endswith("; the ggml engine instead")


@pytest.mark.usefixtures("control")
async def test_engine_auto_goes_on_with_ggml_when_openvino_is_over_the_fidelity_bound(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids: list[int | None] = []

    async def too_far(provider: Provider) -> Checked:
        assert provider.child is not None
        pids.append(provider.child.pid)
        await trio.lowlevel.checkpoint()
        return Checked(refused="over the bound")

    provider = auto_provider(short_dir, monkeypatch, device="CPU", gate=too_far)
    stats = await ready_statistics(provider)
    (openvino_pid,) = pids
    assert openvino_pid is not None
    assert reaped(openvino_pid)
    assert (stats.engine, stats.device, stats.refused, stats.ready) == ("ggml", "CPU", None, True)


@pytest.mark.usefixtures("control")
async def test_engine_auto_goes_on_with_ggml_when_openvino_crashes_at_every_start(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="onebit.provider")
    provider = auto_provider(short_dir, monkeypatch, device="CPU", crashes=True)
    stats = await ready_statistics(provider)
    assert (stats.engine, stats.device, stats.refused, stats.ready) == ("ggml", "CPU", None, True)
    (line,) = [r.getMessage() for r in caplog.records if "engine auto" in r.getMessage()]
    assert line.startswith("ov: engine auto: OpenVINO refused for this model (its llama-server did not start"), line
    assert "SIGSEGV" in line, line


@pytest.mark.usefixtures("control")
async def test_engine_auto_goes_on_with_ggml_when_openvino_prefills_slower_than_the_decoders_engine(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The model's own start-time check (models/parts.py's gate), its decoder and handoff in-process
    fakes: OpenVINO's replies as faithful as the decoder's, its prefill 4 ms a token against the
    decoder's cold 2.5.  Refused with its figures; ggml goes on, and statistics say why."""
    caplog.set_level(logging.INFO, logger="onebit.provider")
    monkeypatch.setenv(openvino.BINARY_ENV, str(openvino_binary(short_dir)))
    restart = {"backoff_initial_s": 0, "backoff_max_s": 0, "max_failures": 2}
    ov = {"kind": "llama-server", "name": "ov", "engine": "auto", "device": "CPU", "threads": 1, "restart": restart}
    config = fake_decoder_config(
        short_dir, hybrid={"enabled": True}, cache={"compile_dir": str(short_dir / "ov")}, provider=[ov]
    )
    (spec,) = modelspec.specs(config)
    parts = Model(spec, runtime_dir=short_dir, settings=Settings(config), check_fidelity=True).parts
    (provider,) = parts.providers.all
    assert isinstance(provider, LlamaServerProvider)
    assert parts.hybrid is not None
    fake = FakeDecoder(handoff={1: 0.6, 2: 0.4}, cold={1: 0.6, 2: 0.4}, cached={1: 0.6, 2: 0.4})
    monkeypatch.setattr(parts, "client", fake)
    monkeypatch.setattr(
        parts, "hybrid", attrs.evolve(parts.hybrid, file=cast(FileHandoff, FakeHandoff(fake, ms_per_token=4.0)))
    )

    async def ready(*_: object) -> ChildState:
        await trio.lowlevel.checkpoint()
        return ChildState.READY

    monkeypatch.setattr(parts.decoder, "wait_state", ready)
    parts.capability.set(Restores.WHOLE, "a restore spared the prompt")
    stats = await ready_statistics(provider)
    assert (stats.engine, stats.device, stats.refused, stats.ready) == ("ggml", "CPU", None, True)
    assert stats.fell_back == (
        "OpenVINO refused, the ggml engine instead: prefill 4 ms a token, the decoder's own engine 2.5 ms a token"
        " (medians over the prompts): not faster than the decoder's own engine on this model"
    )
    (line,) = [r.getMessage() for r in caplog.records if "engine auto" in r.getMessage()]
    assert "prefill 4 ms a token, the decoder's own engine 2.5 ms a token" in line


async def test_a_share_jobs_claim_names_the_recurrent_state_rows_it_copied_into_the_region(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # onebitd adopts a hybrid's share only when the claim says every lent state row was written.
    provider, _ = provider_for(short_dir)

    async def prefilled(slot: int, job: PrefillJob) -> Claim:
        return Claim(n_tokens=len(job.tokens), prefill_ms=2.5, evaluated=len(job.tokens))

    def copied(path: Path, tokens: list[int], layout: object, fds: list[int]) -> Written:
        return Written(len(tokens), 4)

    monkeypatch.setattr(provider, "_prefill_in", prefilled)
    monkeypatch.setattr(llama_provider, "write_saved_state", copied)
    job = ShareJob("req-1", "fake-model", 4096, (1, 2, 3), "s-1", {"tensors": []}, ())
    with trio.fail_after(5):
        claim = await provider.prefill(job)
    assert claim == Claim(n_tokens=3, prefill_ms=2.5, evaluated=3, state_rows=4)
