"""supervisor/routes/fidelity.py without processes: the distance, the bound, and the probe's three paths
against an in-process decoder and handoff."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import attrs
import pytest
import trio

from supervisor.errors import DecoderError, ProviderError, ProviderStateRefused
from supervisor.providers import Provider
from supervisor.reasons import Reason
from supervisor.routes import fidelity
from supervisor.routes.decision import Outcome, Route, Step
from supervisor.routes.fidelity import Probe, Sample, judge, top_k, total_variation
from supervisor.routes.handover import learn
from supervisor.routes.rates import Rates
from tests.rigs.rig import ScriptedProvider
from tests.unit.llama.test_statefile import kv_part, recurrent_part, state_of


def reply(probs: dict[int, float], prompt_n: int = 1) -> dict[str, Any]:
    top = [{"id": t, "token": str(t), "logprob": math.log(p)} for t, p in probs.items()]
    first = {"id": next(iter(probs)), "logprob": top[0]["logprob"], "top_logprobs": top}
    return {"completion_probabilities": [first], "timings": {"prompt_n": prompt_n, "prompt_ms": 2.5 * prompt_n}}


def test_the_top_k_of_a_reply_are_its_first_tokens_probabilities() -> None:
    got = top_k(reply({5: 0.5, 7: 0.25}))
    assert got.keys() == {5, 7}
    assert got[5] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no top-k"):
        top_k({"content": "x"})


def test_total_variation_is_zero_for_the_same_list_and_counts_the_unlisted_mass() -> None:
    p = {1: 0.6, 2: 0.3}
    assert total_variation(p, p) == 0
    # 2 dropped out of q's list: its 0.3 moved to a token q lists instead.
    assert total_variation(p, {1: 0.6, 3: 0.3}) == pytest.approx(0.3)
    # The same listed tokens, mass moved into the unlisted rest.
    assert total_variation(p, {1: 0.5, 2: 0.3}) == pytest.approx(0.1)
    assert total_variation({1: 1.0}, {2: 1.0}) == 1.0


def test_the_bound_is_a_factor_of_the_cold_paths_distance_plus_a_floor() -> None:
    samples = [
        Sample(100, handoff=0.05, cold=0.02, same_top1=True),
        Sample(120, handoff=0.07, cold=0.04, same_top1=False),
    ]
    verdict = judge(samples, factor=2.0, floor=0.01)
    assert verdict.mean_handoff == pytest.approx(0.06)
    assert verdict.bound == pytest.approx(2.0 * 0.03 + 0.01)
    assert verdict.ok
    assert verdict.top1_agree == 0.5
    assert not judge(samples, factor=1.0, floor=0.0).ok
    assert "over 2 prompts" in verdict.summary()


class FakeDecoder:
    """The decoder's /completion, by path: what the slot holds decides the distribution."""

    def __init__(self, *, handoff: dict[int, float], cold: dict[int, float], cached: dict[int, float]) -> None:
        self.paths = {"handoff": handoff, "cold": cold, "cached": cached}
        self.slot = "empty"
        self.calls: list[str] = []

    async def post_json(self, path: str, body: Any) -> tuple[int, Any]:
        await trio.lowlevel.checkpoint()
        if path.endswith("action=erase"):
            self.slot = "empty"
            self.calls.append("erase")
            return 200, {}
        if path == "/tokenize":
            return 200, {"tokens": list(range(len(body["content"].split())))}
        if path.endswith("action=save"):  # no file: the state is not compared (StateDecoder's is)
            self.calls.append("save")
            return 200, {"n_saved": 1}
        n = len(body["prompt"])
        if not body["cache_prompt"]:
            self.slot = "own"
            self.calls.append("cold")
            return 200, reply(self.paths["cold"], prompt_n=n)
        if self.slot == "empty":
            self.slot = "own"
            self.calls.append("prefill")
            return 200, reply(self.paths["cold"], prompt_n=n)
        which = "cached" if self.slot == "own" else "handoff"
        self.calls.append(which)
        return 200, reply(self.paths[which], prompt_n=1)


class FakeHandoff:
    """The file route's handoff: the slot restored, the provider's prefill 9 ms, or ``ms_per_token``
    a prompt token (a provider that prefills slowly: the fake decoder's cold prefill takes 2.5)."""

    def __init__(
        self, decoder: FakeDecoder, *, fails: bool = False, refused: bool = False, ms_per_token: float | None = None
    ) -> None:
        self.decoder = decoder
        self.fails = fails
        self.refused = refused
        self.ms_per_token = ms_per_token

    async def run(self, *, req: str, slot: int, tokens: list[int], provider: Provider, timeout_s: float) -> Outcome:
        await trio.lowlevel.checkpoint()
        if self.refused:
            return Outcome(Route.FILE, Step.RESTORE, Reason.RESTORE_REFUSED, "restore answered 400: n_stream mismatch")
        if self.fails:
            return Outcome(Route.FILE, Step.FILE_PREFILL, Reason.PROVIDER_FAILED, "provider failed: boom")
        self.decoder.slot = "restored"
        prefill_ms = 9.0 if self.ms_per_token is None else self.ms_per_token * len(tokens)
        return Outcome(Route.FILE, prefill_ms=prefill_ms, evaluated=len(tokens), state_bytes=1 << 20, handoff_ms=3.0)


async def test_the_probe_compares_the_handoff_and_the_cold_prefill_with_the_cached_path() -> None:
    decoder = FakeDecoder(handoff={1: 0.5, 2: 0.5}, cold={1: 0.6, 2: 0.4}, cached={1: 0.7, 2: 0.3})
    probe = Probe(client=decoder, handoff=FakeHandoff(decoder), timeout_s=5)
    with trio.fail_after(5):
        tokens = await probe.tokens("one two three four")
        sample = await probe.sample(ScriptedProvider(), 0, tokens)
    assert sample.n_tokens == 4
    assert sample.handoff == pytest.approx(0.2)
    assert sample.cold == pytest.approx(0.1)
    assert sample.same_top1
    assert decoder.calls == ["erase", "prefill", "cached", "cold", "handoff", "erase"]


async def test_the_probes_prefills_are_the_rates_first_measurements() -> None:
    # The decoder's cold prefill and the provider's handoff, as a request's would teach the rates:
    # on shared cores a provider is taken only where it was measured cheaper.
    decoder = FakeDecoder(handoff={1: 0.5, 2: 0.5}, cold={1: 0.6, 2: 0.4}, cached={1: 0.7, 2: 0.3})
    probe = Probe(client=decoder, handoff=FakeHandoff(decoder), timeout_s=5)
    with trio.fail_after(5):
        sample = await probe.sample(ScriptedProvider(), 0, await probe.tokens("one two three four"))
    assert sample.cold_ms == 10.0  # 4 tokens evaluated cold
    assert sample.outcome is not None
    assert (sample.outcome.prefill_ms, sample.outcome.evaluated) == (9.0, 4)
    rates = Rates(decoder_ms_per_token=5.0, provider_ms_per_token=5.0, handoff_ms_per_mib=1.0, state_bytes_per_token=1)
    rates.observe_decoder(1, sample.n_tokens, sample.cold_ms)
    learn(rates, "scripted", sample.n_tokens, sample.outcome)
    assert rates.decoder.samples == rates.provider("scripted").samples == 1
    assert rates.handoff_ms(4) == pytest.approx(3.0)


async def test_a_failed_handoff_or_a_lost_decoder_is_a_provider_error_and_the_slot_is_erased() -> None:
    decoder = FakeDecoder(handoff={1: 1.0}, cold={1: 1.0}, cached={1: 1.0})
    probe = Probe(client=decoder, handoff=FakeHandoff(decoder, fails=True), timeout_s=5)
    with trio.fail_after(5), pytest.raises(ProviderError, match="the handoff failed: provider failed: boom"):
        await probe.sample(ScriptedProvider(), 0, [1, 2, 3])
    assert decoder.calls[-1] == "erase"

    class Lost:
        async def post_json(self, path: str, body: Any) -> tuple[int, Any]:
            await trio.lowlevel.checkpoint()
            raise DecoderError("connection refused")

    with trio.fail_after(5), pytest.raises(ProviderError, match="connection refused"):
        await Probe(client=Lost(), handoff=FakeHandoff(decoder), timeout_s=5).tokens("x")


def test_a_prompt_set_is_that_many_different_prompts_the_start_prompts_first_and_at_most_34() -> None:
    # 34: the benchmark's set (bench/providers.py); the real-parts test takes 33.
    start = len(fidelity.START_PROMPTS)
    for n in (1, start, start + 1, 33, 34):
        texts = fidelity.prompt_set(n)
        assert len(texts) == n
        assert len(set(texts)) == n, "a prompt twice: the mean distance would count it twice"
        assert tuple(texts[:start]) == fidelity.START_PROMPTS[:n]
    assert all(text.strip() for text in fidelity.prompt_set(34))
    with pytest.raises(ValueError, match="at most 34 prompts"):
        fidelity.prompt_set(35)


async def test_a_refused_restore_is_a_refusal_of_the_providers_state_not_a_passing_failure() -> None:
    decoder = FakeDecoder(handoff={1: 1.0}, cold={1: 1.0}, cached={1: 1.0})
    probe = Probe(client=decoder, handoff=FakeHandoff(decoder, refused=True), timeout_s=5)
    with trio.fail_after(5), pytest.raises(ProviderStateRefused, match="n_stream mismatch"):
        await probe.sample(ScriptedProvider(), 0, [1, 2, 3])


def test_one_prompt_far_off_is_refused_though_the_mean_is_within_the_bound() -> None:
    # Three prompts the handoff keeps exactly, one it moves four times the cold path's worst.
    samples = [Sample(100, handoff=0.0, cold=0.03, same_top1=True) for _ in range(3)]
    samples.append(Sample(690, handoff=0.2, cold=0.03, same_top1=False))
    verdict = judge(samples, factor=3.0, floor=0.02)
    assert verdict.mean_handoff <= verdict.bound  # the mean alone would admit it
    assert verdict.max_handoff > verdict.worst_bound == pytest.approx(3.0 * 0.03 + 0.02)
    assert not verdict.ok
    assert "worst 0.2000" in verdict.summary()


def test_the_gate_takes_the_prompts_that_fit_a_slot() -> None:
    prompts = [[1] * 100, [1] * 690]
    assert fidelity.fitting(prompts, 1024) == prompts
    assert fidelity.fitting(prompts, 512) == [prompts[0]]
    assert fidelity.fitting(prompts, None) == prompts


async def test_a_provider_that_answers_its_prefill_with_an_error_is_refused_not_asked_again() -> None:
    class Answered(FakeHandoff):
        async def run(self, *, req: str, slot: int, tokens: list[int], provider: Provider, timeout_s: float) -> Outcome:
            await trio.lowlevel.checkpoint()
            why = "provider failed: ov: prefill answered 500: Compute error."
            return Outcome(Route.FILE, Step.FILE_PREFILL, Reason.PROVIDER_FAILED, why, answered=True)

    fake = FakeDecoder(handoff={1: 1.0}, cold={1: 1.0}, cached={1: 1.0})
    probe = Probe(client=fake, handoff=Answered(fake), timeout_s=1)
    with trio.fail_after(5), pytest.raises(ProviderStateRefused, match="it cannot prefill this model: provider failed"):
        await probe.sample(cast(Provider, None), 0, [1, 2, 3])
    assert fake.calls[-1] == "erase"


async def test_the_check_times_both_engines_and_a_chosen_engine_no_faster_than_the_decoders_is_refused() -> None:
    # The handoff as faithful as the cold path; the provider's prefill 4 ms a token against the
    # decoder's 2.5 (the fake decoder's cold prompt_ms).
    decoder = FakeDecoder(handoff={1: 0.6, 2: 0.4}, cold={1: 0.6, 2: 0.4}, cached={1: 0.6, 2: 0.4})
    probe = Probe(client=decoder, handoff=FakeHandoff(decoder, ms_per_token=4.0), timeout_s=5)
    with trio.fail_after(5):
        samples = [await probe.sample(ScriptedProvider(), 0, await probe.tokens(text)) for text in ("a b c d", "e f")]
    verdict = judge(samples)
    assert verdict.ok
    assert (verdict.provider_ms_per_token, verdict.decoder_ms_per_token) == (4.0, 2.5)
    assert verdict.faster is False
    assert "prefill 4 ms a token, the decoder's own engine 2.5 ms a token" in verdict.summary()
    # Configured for its engine, it is admitted (the route chooser weighs it per request) ...
    assert verdict.refusal(must_be_faster=False) is None
    # ... chosen by engine "auto", it is refused, with its figures.
    why = verdict.refusal(must_be_faster=True)
    assert why == (
        "prefill 4 ms a token, the decoder's own engine 2.5 ms a token (medians over the prompts):"
        " not faster than the decoder's own engine on this model"
    )
    outcomes = [s.outcome for s in samples if s.outcome is not None]
    fast = judge(
        [
            attrs.evolve(s, outcome=attrs.evolve(o, prefill_ms=s.n_tokens * 1.0))
            for s, o in zip(samples, outcomes, strict=True)
        ]
    )
    assert fast.faster
    assert fast.refusal(must_be_faster=True) is None


def test_a_speed_not_measured_is_not_faster() -> None:
    verdict = judge([Sample(100, handoff=0.0, cold=0.03, same_top1=True)])
    assert verdict.faster is None
    assert verdict.refusal(must_be_faster=False) is None
    why = verdict.refusal(must_be_faster=True)
    assert why is not None
    assert why.startswith("prefill not measured, the decoder's own engine not measured")


class StateDecoder(FakeDecoder):
    """A fake decoder whose slot saves write a state file: the decoder's own after its prefill, the
    provider's after the handoff's restore (``own`` and ``provided``)."""

    def __init__(self, state_dir: Path, *, own: bytes, provided: bytes) -> None:
        same = {1: 0.6, 2: 0.4}
        super().__init__(handoff=same, cold=same, cached=same)
        self.state_dir = state_dir
        self.states = {"own": own, "restored": provided}
        self.prefilled: list[int] = []

    async def post_json(self, path: str, body: Any) -> tuple[int, Any]:
        if path.endswith("action=save"):
            await trio.lowlevel.checkpoint()
            self.calls.append(f"save {self.slot}")
            (self.state_dir / body["filename"]).write_bytes(self.states[self.slot])
            return 200, {"n_saved": 1}
        if body.get("n_predict") == 0:
            self.prefilled.append(len(body["prompt"]))
        return await super().post_json(path, body)


def hybrid_state(*, pos: int, k: float, s: float) -> bytes:
    """One KV cell (position 0) and a recurrent memory's one cell at ``pos``."""
    return state_of(kv_part([(0, [k, 1.0], [1.0, 1.0])]), recurrent_part(pos, [1.0, 1.0], [s]))


async def sampled(tmp_path: Path, provided: bytes, *, kv_state: bool = True) -> tuple[Sample, StateDecoder]:
    decoder = StateDecoder(tmp_path, own=hybrid_state(pos=3, k=1.0, s=1.0), provided=provided)
    probe = Probe(client=decoder, handoff=FakeHandoff(decoder), timeout_s=5, state_dir=tmp_path, short_by=1)
    with trio.fail_after(5):
        sample = await probe.sample(ScriptedProvider(), 0, [1, 2, 3, 4, 5], kv_state=kv_state)
    # The decoder's own state of the tokens the file route hands over (one short), saved before its
    # cached path; the provider's saved after the restore, before the decoder evaluates the rest.
    assert decoder.prefilled == [4]
    saves = ["save own", "cached", "cached", "cold", "save restored", "handoff"]
    assert decoder.calls == ["erase", "prefill", *saves, "erase"]
    assert list(await trio.Path(tmp_path).iterdir()) == [], "a state file left behind"
    return sample, decoder


async def test_a_handed_over_state_past_the_bound_is_refused_with_its_tensor_and_error(tmp_path: Path) -> None:
    # The next token as the cached path's (the tiny models' near-uniform logits): only the state shows it.
    sample, _ = await sampled(tmp_path, hybrid_state(pos=3, k=1.0, s=50.0))
    assert sample.handoff == 0.0
    assert sample.state is not None
    assert (sample.state.tensor, sample.state.error, sample.state.differences) == ("S", 49.0, ())
    verdict = judge([sample])
    assert not verdict.ok
    why = verdict.refusal(must_be_faster=False)
    assert why is not None
    assert why.startswith("state S off by 49 (bound 0.1); per prompt: S 49 (KV+R/S, ")
    assert "s): over the bound; next-token TV distance over 1 prompts" in why


async def test_a_handed_over_state_whose_cells_differ_is_refused(tmp_path: Path) -> None:
    # The provider's recurrent cell one position on, its values the decoder's own.
    sample, _ = await sampled(tmp_path, hybrid_state(pos=4, k=1.0, s=1.0))
    assert sample.state is not None
    assert sample.state.error == 0.0
    assert sample.state.differences == ("recurrent: cells at 4..4 (1) against 3..3 (1)",)
    why = judge([sample]).refusal(must_be_faster=False)
    assert why is not None
    assert why.startswith("state cells differ: recurrent: cells at 4..4 (1) against 3..3 (1);")


async def test_a_handed_over_state_within_the_bound_is_admitted_and_its_figures_said(tmp_path: Path) -> None:
    sample, _ = await sampled(tmp_path, hybrid_state(pos=3, k=1.0, s=1.05))
    verdict = judge([sample])
    assert verdict.ok
    assert verdict.refusal(must_be_faster=False) is None
    assert "state: worst S 0.05 (bound 0.1); per prompt: S 0.05 (KV+R/S, " in verdict.summary()
    # The KV caches' values are measured only where asked (the gate's first prompt): a K far off
    # then goes unseen, the recurrent parts are still measured.
    far_k = hybrid_state(pos=3, k=9.0, s=1.05)
    (tmp_path / "kv").mkdir()
    assert not judge([(await sampled(tmp_path / "kv", far_k))[0]]).ok
    (tmp_path / "rs").mkdir()
    recurrent_only, _ = await sampled(tmp_path / "rs", far_k, kv_state=False)
    assert recurrent_only.state is not None
    assert (recurrent_only.state.tensor, recurrent_only.state.kv) == ("S", False)
    assert judge([recurrent_only]).ok
