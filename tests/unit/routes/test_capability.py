"""What a model's restores can do, proven at its load (supervisor/routes/capability.py), and what each
verdict does to a request's route, against tests/fakes/llama/inprocess.py: a dense model's restore spares the
whole prompt, a recurrent one's only a state saved short of it (tests/unit/routes/test_hybrid_store.py), and one
that restores nothing turns the hybrid routes and the prefix store off with ``fallback=restore-unusable``.  The same on
the real llama-server, per family: tests/real/test_real_families.py."""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import IO, Any

import pytest
import trio

from supervisor.api.local import ProviderReadiness, health
from supervisor.config import convert, modelspec
from supervisor.config.live import Settings
from supervisor.errors import ConfigError
from supervisor.llama import answers, gguf
from supervisor.models import layout
from supervisor.models.model import Model
from supervisor.reasons import Reason
from supervisor.routes import capability
from supervisor.routes.capability import Capability, Restores, verdict
from supervisor.routes.decision import Ask, Offer, Policy, Route, choose
from supervisor.routes.stored import StoredPrefixes
from supervisor.supervise.child import ChildState
from tests.fakes.llama.core import Modes
from tests.fakes.llama.inprocess import FakeLlama
from tests.rigs.rig import ScriptedProvider, fake_decoder_config, gguf_header
from tests.unit.routes.test_completions import M, body_for, make_rig, state_files
from tests.unit.routes.test_hybrid_store import hybrid_rig

TIMEOUT = 10
TOKENS = list(range(3, 43))


@pytest.mark.parametrize(
    ("whole", "short", "expected"),
    [
        (1, None, Restores.WHOLE),
        (2, None, Restores.WHOLE),
        (40, 1, Restores.PREFIX),
        (40, 40, Restores.NONE),
        (40, None, Restores.NONE),
        (None, None, Restores.UNPROBED),
    ],
)
def test_the_verdict_is_read_from_the_two_re_asks(whole: int | None, short: int | None, expected: Restores) -> None:
    assert verdict(whole, short) is expected


@pytest.mark.parametrize(
    ("modes", "expected"),
    [(Modes(), Restores.WHOLE), (Modes(recurrent=True), Restores.PREFIX), (Modes(restore_unused=True), Restores.NONE)],
    ids=["dense", "recurrent", "restores-nothing"],
)
async def test_the_probe_finds_what_a_restore_spares_and_leaves_nothing_behind(
    tmp_path: Path, modes: Modes, expected: Restores
) -> None:
    fake = FakeLlama(tmp_path, modes=modes)
    with trio.fail_after(TIMEOUT):
        found, why = await capability.probe(fake.client(), 1, TOKENS, tmp_path)
    assert found is expected, why
    assert fake.slots[1] == []  # erased after
    assert state_files(tmp_path) == []
    asked = [a for a, slot in fake.actions if slot == 1]
    assert asked[:3] == ["save", "erase", "restore"]
    if expected is Restores.PREFIX:
        # The second state was saved one token short, and the re-ask evaluated that token.
        assert [len(r.prompt) for r in fake.requests] == [40, 40, 39, 40]
        assert fake.requests[-1].prompt_n == 1


async def test_a_probe_the_decoder_refuses_is_unprobed_with_its_words(tmp_path: Path) -> None:
    fake = FakeLlama(tmp_path, modes=Modes(restore_refuse=True))
    with trio.fail_after(TIMEOUT):
        found, why = await capability.probe(fake.client(), 0, TOKENS, tmp_path)
    assert found is Restores.UNPROBED
    assert why.startswith("the probe could not run: restore answered 400: ")
    assert state_files(tmp_path) == []


async def test_the_probe_prompt_is_the_models_own_tokens_within_half_a_slot(tmp_path: Path) -> None:
    fake = FakeLlama(tmp_path)
    with trio.fail_after(TIMEOUT):
        tokens = await capability.prompt_tokens(fake.client(), capability.probe_length(64))
    assert len(tokens) == 32
    assert capability.probe_length(None) == capability.PROBE_TOKENS
    assert capability.probe_length(4096) == capability.PROBE_TOKENS


def test_each_verdict_says_what_runs() -> None:
    found = Capability("m")
    assert (found.handoff, found.store, found.short_by) == (True, True, 0)  # unprobed: as before
    found.set(Restores.PREFIX, "recurrent")
    assert (found.handoff, found.store, found.short_by, found.at_boundary) == (True, True, 1, True)
    found.set(Restores.NONE, "nothing")
    assert (found.handoff, found.store) == (False, False)
    found.set(Restores.WHOLE, "dense")
    assert (found.handoff, found.store, found.short_by) == (True, True, 0)


def test_a_withdrawal_is_said_once_at_warning_and_holds(caplog: pytest.LogCaptureFixture) -> None:
    found = Capability("m")
    found.set(Restores.WHOLE, "dense")
    with caplog.at_level(logging.INFO, logger="onebit.model"):
        found.withdraw("first")
        found.withdraw("second")
        found.set(Restores.WHOLE, "probed again after a restart")
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "model m: restores withdrawn until its next load" in caplog.records[0].getMessage()
    assert (found.handoff, found.store, found.words) == (False, False, "withdrawn: first")


def test_an_unusable_restore_keeps_a_request_plain_before_any_provider_is_asked() -> None:
    kept = choose(Ask(100), Offer(enabled=True, restorable=False), policy=Policy(min_prompt_tokens=4))
    assert (kept.route, kept.reasons) == (Route.PLAIN, (Reason.RESTORE_UNUSABLE,))
    over = choose(
        Ask(None, kept=Reason.OVER_CONTEXT), Offer(enabled=True, restorable=False), policy=Policy(min_prompt_tokens=4)
    )
    assert over.reasons == (Reason.OVER_CONTEXT,)


async def test_a_model_whose_restores_spare_nothing_starts_no_provider_job(tmp_path: Path) -> None:
    provider = ScriptedProvider()
    rig = make_rig(tmp_path, provider)
    rig.completions.capability = found = Capability("fake-model")
    found.set(Restores.NONE, "nothing")
    with trio.fail_after(TIMEOUT):
        reply = await rig.post("/completion", body_for(False))
    assert reply.status == 200
    [line] = rig.lines
    assert (line.route, line.fallback, line.decoder_prompt_n) == ("plain", "restore-unusable", M)
    assert provider.jobs == []


async def test_a_recurrent_model_hands_over_its_prompt_less_the_last_token(tmp_path: Path) -> None:
    provider = ScriptedProvider()
    rig = hybrid_rig(tmp_path, provider)
    with trio.fail_after(TIMEOUT):
        reply = await rig.post("/completion", body_for(False))
    assert reply.status == 200
    [line] = rig.lines
    assert (line.route, line.fallback, line.decoder_prompt_n) == ("file", None, 1)
    [job] = provider.jobs
    assert len(job.tokens) == M - 1


async def test_a_restore_the_decoder_ignored_withdraws_the_capability_for_the_load(tmp_path: Path) -> None:
    provider = ScriptedProvider()
    rig = make_rig(tmp_path, provider)
    rig.fake.modes = Modes(restore_unused=True)
    rig.completions.capability = found = Capability("fake-model")
    found.set(Restores.WHOLE, "dense")
    with trio.fail_after(TIMEOUT):
        await rig.post("/completion", body_for(False))
        await rig.post("/completion", {**body_for(False), "prompt": "another prompt of nine words for the decoder"})
    first, second = rig.lines
    assert (first.route, first.fallback) == ("file", "restore-unused")
    assert found.withdrawn is not None
    assert first.req in found.withdrawn
    assert (second.route, second.fallback) == ("plain", "restore-unusable")
    assert len(provider.jobs) == 1


@pytest.mark.parametrize(
    ("restores", "enabled"), [(Restores.WHOLE, True), (Restores.PREFIX, True), (Restores.NONE, False)]
)
async def test_the_prefix_store_is_off_where_a_restored_prefix_cannot_spare_it(
    tmp_path: Path, restores: Restores, enabled: bool
) -> None:
    from tests.unit.prefix.test_prefix_store import private_store
    from tests.unit.routes.test_completions import FINGERPRINT

    store = await private_store(tmp_path / "store", fingerprint=FINGERPRINT, max_bytes=1 << 20, min_tokens=4)
    found = Capability("m")
    found.set(restores, "probed")
    stored = StoredPrefixes(client=FakeLlama(tmp_path).client(), state_dir=tmp_path, store=store, capability=found)
    assert stored.enabled is enabled
    store.close()


def test_health_names_the_models_whose_restores_spare_nothing() -> None:
    ready = ProviderReadiness()
    status, body = health(ChildState.READY, ready, draining=False, stopping=False, unrestorable={"m": "none: why"})
    assert (status, body) == (200, {"status": "ok", "restores_unusable": {"m": "none: why"}})
    assert health(ChildState.READY, ready, draining=False, stopping=False)[1] == {"status": "ok"}


def test_health_names_the_models_whose_decoder_refused_the_share_route() -> None:
    refused = {"m": "share: no; this decoder cannot share its KV (memory kv+recurrent)"}
    status, body = health(ChildState.READY, ProviderReadiness(), draining=False, stopping=False, share_refused=refused)
    assert (status, body) == (200, {"status": "ok", "share_refused": refused})


def test_a_slots_real_context_is_read_from_props_and_the_models_list() -> None:
    props = {"default_generation_settings": {"n_ctx": 8192}, "total_slots": 2}
    models = {"data": [{"id": "m", "meta": {"n_ctx_train": 8192}}]}
    assert answers.slot_context(props, models) == answers.SlotContext(8192, 8192, 2)
    assert answers.slot_context({"total_slots": 2}, models) is None
    assert answers.slot_context(props, None) == answers.SlotContext(8192, None, 2)


@pytest.mark.parametrize("value", ['"auto"', "true", "false"])
def test_swa_full_takes_auto_or_a_boolean(value: str) -> None:
    config = convert.loads(f"[model]\nswa_full = {value}\n")
    assert config.model.swa_full == {"auto": "auto", "true": True, "false": False}[value.strip('"')]


def test_swa_full_names_its_key_when_wrong() -> None:
    with pytest.raises(ConfigError, match=r'model\.swa_full: expected "auto", true or false, got "yes"'):
        convert.loads('[model]\nswa_full = "yes"\n')


def _header(arch: str, pairs: list[tuple[str, int, Any]]) -> io.BytesIO:
    return io.BytesIO(gguf_header(arch, pairs))


def test_a_hybrid_models_per_layer_heads_count_only_its_attention_layers() -> None:
    shape = gguf.read_shape(
        _header(
            "lfm2",
            [
                ("block_count", 4, 4),
                ("embedding_length", 4, 256),
                ("context_length", 4, 256),
                ("attention.head_count", 9, [2, 0, 2, 0]),
                ("attention.head_count_kv", 9, [2, 0, 2, 0]),
                ("attention.sliding_window", 4, 32),
                ("shortconv.l_cache", 4, 3),
            ],
        )
    )
    assert (shape.attention_layers, shape.recurrent_layers, shape.sliding_window) == (2, 2, 32)
    assert shape.context_length == 256
    assert shape.kv_bytes_per_token() == 2 * 2 * 128 * 4  # 2 layers, 2 heads x 128, K and V in f16
    assert shape.recurrent_bytes() == 2 * (3 - 1) * 256 * 4


async def test_a_load_reads_its_models_gguf_header_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The layout choice, its memory estimate and the probe's hint all take the load's one read."""
    path = tmp_path / "gemma3.gguf"
    header = _header(
        "gemma3",
        [
            ("block_count", 4, 2),
            ("embedding_length", 4, 64),
            ("context_length", 4, 256),
            ("attention.head_count", 4, 2),
            ("attention.head_count_kv", 4, 2),
            ("attention.sliding_window", 4, 32),
        ],
    )
    path.write_bytes(header.getvalue())
    config = fake_decoder_config(tmp_path, model_file=path, model={"swa_full": "auto"}, models={"memory_budget_mib": 1})
    reads = []
    real_read = gguf.read_shape

    def counted(file: IO[bytes]) -> gguf.Shape:
        reads.append(file)
        return real_read(file)

    async def no_restores(*_: object) -> tuple[Restores, str]:
        return Restores.NONE, "a restored state re-evaluated the prompt"

    async def tokens(*_: object) -> list[int]:
        return TOKENS

    monkeypatch.setattr(gguf, "read_shape", counted)
    monkeypatch.setattr(capability, "prompt_tokens", tokens)
    monkeypatch.setattr(capability, "probe", no_restores)
    (spec,) = modelspec.specs(config)
    # As the daemon makes it: the model's memory estimate and its first load's parts share the read.
    model = Model(spec, runtime_dir=tmp_path, settings=Settings(config), check_fidelity=False)
    parts = model.parts
    assert model.estimate_mib > 0
    assert parts.swa_full is False  # its estimate (taken) is over the 1 MiB budget
    with trio.fail_after(TIMEOUT), caplog.at_level(logging.INFO, "onebit.model"):
        await parts.after_start(store_enabled=True)
    assert "model.swa_full = true would keep its whole cache" in caplog.text
    assert len(reads) == 1


@pytest.mark.parametrize(
    ("kind", "fidelity_check", "check_fidelity", "gated"),
    [
        ("exec", True, True, True),
        ("worker", True, True, True),
        ("exec", False, True, False),
        ("worker", False, True, False),
        ("exec", True, False, False),
    ],
)
def test_an_exec_or_worker_program_is_measured_at_start_unless_its_config_vouches_for_it(
    tmp_path: Path, kind: str, fidelity_check: bool, check_fidelity: bool, gated: bool
) -> None:
    """onebitd cannot see what a program computes on: its KV is checked like another engine's."""
    program = {"kind": kind, "name": "npu0", "command": ["/bin/true"], "fidelity_check": fidelity_check}
    config = fake_decoder_config(tmp_path, hybrid={"enabled": True}, provider=[program])
    (spec,) = modelspec.specs(config)
    model = Model(spec, runtime_dir=tmp_path, settings=Settings(config), check_fidelity=check_fidelity)
    (provider,) = model.parts.providers.all
    assert provider.kind == kind
    assert (getattr(provider, "gate", None) is not None) is gated
    if kind == "exec":  # nothing to start: ready at once unless measured first
        assert provider.ready is not gated


async def test_a_later_start_takes_the_first_probes_verdict_and_a_withdrawn_one_is_probed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A swap back or a restart after a crash runs the same build, flags and file: the probe's
    save, erase and restore (about 0.6 s of SmolLM2's swap) is not paid again, unless the
    capability was withdrawn since."""
    probes = []

    async def dense(*_: object) -> tuple[Restores, str]:
        probes.append(1)
        return Restores.WHOLE, "a restore spared the prompt"

    async def tokens(*_: object) -> list[int]:
        return TOKENS

    monkeypatch.setattr(capability, "prompt_tokens", tokens)
    monkeypatch.setattr(capability, "probe", dense)
    (spec,) = modelspec.specs(fake_decoder_config(tmp_path))
    model = Model(spec, runtime_dir=tmp_path, settings=Settings(spec.config), check_fidelity=False)
    with trio.fail_after(TIMEOUT):
        await model.parts.after_start(store_enabled=True)
        await model.parts.after_start(store_enabled=True)  # a restart after a crash
        model.fresh_parts()  # unloaded: the next load's parts
        await model.parts.after_start(store_enabled=True)
        assert (len(probes), model.parts.capability.restores, model.parts.capability.store) == (1, Restores.WHOLE, True)
        model.parts.capability.withdraw("req-1 re-evaluated its prompt")
        assert not model.parts.capability.store
        model.fresh_parts()
        await model.parts.after_start(store_enabled=True)
    assert (len(probes), model.parts.capability.withdrawn, model.parts.capability.store) == (2, None, True)


async def test_a_load_whose_sliding_window_layers_are_kept_otherwise_is_probed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a restore can do rests on ``--swa-full``, which the memory budget can turn on or off at a
    reload (``model.swa_full = "auto"``): the next load with the other layout probes again."""
    probes: list[bool] = []
    swa_full = [False]

    async def probe(*_: object) -> tuple[Restores, str]:
        probes.append(swa_full[0])
        return (Restores.WHOLE, "kept whole") if swa_full[0] else (Restores.NONE, "the window only")

    async def tokens(*_: object) -> list[int]:
        return TOKENS

    monkeypatch.setattr(capability, "prompt_tokens", tokens)
    monkeypatch.setattr(capability, "probe", probe)
    monkeypatch.setattr(layout, "swa_full", lambda *_: swa_full[0])
    (spec,) = modelspec.specs(fake_decoder_config(tmp_path))
    model = Model(spec, runtime_dir=tmp_path, settings=Settings(spec.config), check_fidelity=False)
    with trio.fail_after(TIMEOUT):
        await model.parts.after_start(store_enabled=True)
        swa_full[0] = True  # a reload gave the budget room for the whole cache
        model.fresh_parts()
        await model.parts.after_start(store_enabled=True)
        assert (probes, model.parts.capability.restores) == ([False, True], Restores.WHOLE)
        model.fresh_parts()  # the same layout again: the verdict taken unprobed
        await model.parts.after_start(store_enabled=True)
    assert (probes, model.parts.capability.restores) == ([False, True], Restores.WHOLE)
