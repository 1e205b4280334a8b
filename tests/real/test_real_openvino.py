"""The OpenVINO provider against the real parts: llama-server on OpenVINO's CPU device as the provider,
the ggml llama-server as the decoder, SmolLM2.  The whole file route, the static (NPU) path forced on
the CPU, a provider that dies mid-prefill (the request goes plain and is counted), and the compile
cache reused by a second start.  Without the OpenVINO llama-server scripts/setup builds they fail,
saying so; they skip only where set-up was told to build none (ONEBIT_NO_OPENVINO; tests/rigs/rig.py).

Replies are not compared with the plain route's: another engine computes other rounding.  The
first test holds the requests it serves to the fidelity gate's bound instead (supervisor/routes/
fidelity.py: each prompt's next token through the file route against the decoder's own cached and
cold paths, the mean and the worst); tests/real/test_real_fidelity.py holds the gate to it on 30 prompts.
The first two pass the start-time fidelity check; the others are about the route, and leave it out
(``check_fidelity=False``) but those about a refusal."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from supervisor.config import Config
from supervisor.llama import decoder, openvino
from supervisor.providers.llama import LlamaServerProvider
from supervisor.routes import fidelity
from supervisor.supervise.child import ChildState
from tests.rigs.helpers import CHAT, chat, wait_until
from tests.rigs.rig import (
    HANDOFF_ALWAYS,
    RouteLines,
    Running,
    make_config,
    openvino_llama_server,
    real_llama_server,
    run_daemon,
)

pytestmark = pytest.mark.real

QUESTION = "Tell me about the moon in one sentence, please, and mention its phases and its distance from us."
# Compiling the model's graphs takes a few seconds on two busy cores; loading it, as long as ggml's.
START_S = 300


@pytest.fixture
def binary() -> Path:
    """A sync fixture, so that a missing binary fails (or skips) with its reason before the trio run starts."""
    return openvino_llama_server()


def openvino_config(runtime: Path, binary: Path, compile_dir: Path | None = None, **provider: Any) -> Config:
    real_llama_server()
    return make_config(
        runtime,
        model={"parallel": 4, "ctx_size": 4096},
        decoder={"threads": 1},
        hybrid={"enabled": True, "min_prompt_tokens": 16, **HANDOFF_ALWAYS},
        provider=[
            {
                "kind": "llama-server",
                "name": "ov",
                "engine": "openvino",
                "device": "CPU",
                "binary": str(binary),
                "threads": 1,
                **provider,
            }
        ],
        cache={"compile_dir": str(compile_dir or runtime / "openvino")},
    )


async def admitted(running: Running) -> LlamaServerProvider:
    (provider,) = running.daemon.models.default.parts.providers.all
    assert isinstance(provider, LlamaServerProvider)
    await wait_until(lambda: provider.ready or provider.refused is not None)
    assert provider.refused is None, provider.refused
    return provider


async def ask(running: Running, body: dict[str, Any]) -> str:
    async with httpx.AsyncClient(base_url=running.url, timeout=240) as client:
        reply = await client.post(CHAT, json=body)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"]["content"])


async def served_samples(running: Running, texts: Sequence[str]) -> list[fidelity.Sample]:
    """What the fidelity gate promises, measured on requests as served: each prompt's next-token
    distribution from a /completion through onebitd (the file route), against the decoder's own
    cached and cold paths for the same tokens, asked of the decoder itself in its last slot (onebitd
    serves nothing else meanwhile, and the route takes the lowest free slot)."""
    model = running.daemon.models.default
    client, slot = model.client, model.spec.config.model.parallel - 1
    samples = []
    async with httpx.AsyncClient(base_url=running.url, timeout=240) as http:
        for text in texts:
            tokens = await decoder.tokenize(client, text)
            body = {"prompt": tokens, "n_predict": 1, "n_probs": fidelity.TOP_K, "temperature": 0}
            reply = await http.post("/completion", json=body)
            assert reply.status_code == 200, reply.text
            handoff = fidelity.top_k(reply.json())
            paths = []
            for cache in (True, True, False):  # prefill, then the cached path, then the cold one
                answer = await decoder.next_token(client, slot, tokens, n_probs=fidelity.TOP_K, cache=cache)
                assert isinstance(answer, decoder.NextToken), answer
                paths.append(fidelity.top_k(answer.reply))
            assert await decoder.erase(client, slot) is None
            _, cached, cold = paths
            samples.append(
                fidelity.Sample(
                    n_tokens=len(tokens),
                    handoff=fidelity.total_variation(handoff, cached),
                    cold=fidelity.total_variation(cold, cached),
                    same_top1=fidelity.top1(handoff) == fidelity.top1(cached),
                )
            )
    return samples


async def test_an_openvino_provider_on_the_cpu_serves_the_whole_file_route(
    short_dir: Path, binary: Path, route_lines: RouteLines
) -> None:
    with trio.fail_after(START_S + 240):
        # With the start-time fidelity check: it admits the provider (or the test says why not).
        async with run_daemon(openvino_config(short_dir, binary)) as running:
            provider = await admitted(running)
            got = await ask(running, chat(QUESTION, max_tokens=16, temperature=0))
            # A request is counted when its route line is written, after its last byte: wait for it.
            await route_lines.until(1)
            async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
                metrics = (await client.get("/metrics")).text
            stats = provider.statistics()
            decoder_argv = list(running.daemon.models.default.parts.launcher.argv())
            # The gate's promise on the requests it admitted the provider for, judged as the gate
            # judges: the same prompts, the mean and the worst against the decoder's own spread.
            samples = await served_samples(running, fidelity.GATE_PROMPTS)
            served = route_lines.lines[1:]
    assert got.strip()
    line = route_lines.lines[0]
    verdict = fidelity.judge(samples)
    assert verdict.ok, verdict.summary()
    assert [(s["route"], s["fallback"], s["outcome"]) for s in served] == [("file", None, "ok")] * len(samples)
    assert all(s["decoder_prompt_n"] <= 2 for s in served), served
    assert (line["route"], line["fallback"], line["outcome"]) == ("file", None, "ok")
    assert (line["provider"], line["engine"], line["device"]) == ("ov", "openvino", "CPU")
    assert line["decoder_prompt_n"] <= 2
    assert line["prompt_tokens"] >= 16
    # Its jobs: the start-time check's prompts, then the request's (the samples' came after).
    assert (stats.engine, stats.device, stats.jobs, stats.failures) == (
        "openvino",
        "CPU",
        len(fidelity.GATE_PROMPTS) + 1,
        0,
    )
    labels = 'device="CPU",engine="openvino",provider="ov",route="file"'
    assert f"onebit_provider_prefill_seconds_count{{{labels}}} 1.0" in metrics
    assert 'onebit_provider_ready{device="CPU",engine="openvino",kind="llama-server",provider="ov"} 1.0' in metrics
    # A named CPU device is not the static path: the decoder keeps its own KV layout.
    assert "--kv-unified" not in decoder_argv
    assert list((short_dir / "state").iterdir()) == []


async def test_the_static_npu_path_forced_on_the_cpu_hands_over_into_a_unified_kv_decoder(
    short_dir: Path, binary: Path, route_lines: RouteLines
) -> None:
    questions = [QUESTION, QUESTION + " Be brief.", "Name three facts about the number 42, in one sentence each."]
    with trio.fail_after(START_S + 240):
        # With the start-time check too: the static path's KV is held to the same bound.
        async with run_daemon(openvino_config(short_dir, binary, static_shapes=True)) as running:
            provider = await admitted(running)
            provider_argv = list(provider.launcher.argv())
            decoder_argv = list(running.daemon.models.default.parts.launcher.argv())
            got: list[str] = ["", "", ""]

            async def one(i: int) -> None:
                got[i] = await ask(running, chat(questions[i], max_tokens=8, temperature=0))

            # Three at once through the provider's one slot: they queue for it.
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
    assert provider.static
    assert provider_argv[provider_argv.index("-np") + 1] == "1"
    assert "--kv-unified" in provider_argv
    assert decoder_argv[decoder_argv.index("-np") + 1] == "4"
    assert "--kv-unified" in decoder_argv
    assert all(text.strip() for text in got)
    assert len(route_lines.lines) == 3
    for line in route_lines.lines:
        assert (line["route"], line["fallback"], line["engine"], line["device"]) == ("file", None, "openvino", "CPU")
        assert line["decoder_prompt_n"] <= 2
    assert list((short_dir / "state").iterdir()) == []


async def test_an_openvino_provider_that_dies_mid_prefill_sends_the_request_plain_and_is_counted(
    short_dir: Path, binary: Path, route_lines: RouteLines
) -> None:
    # Long enough that its prefill is still running when the kill lands (about a second on OpenVINO).
    long_question = " ".join(f"Item {i} weighs {i * 7 % 101} grams." for i in range(90)) + " Which is heaviest?"
    with trio.fail_after(START_S + 240):
        async with run_daemon(openvino_config(short_dir, binary), check_fidelity=False) as running:
            provider = await admitted(running)
            pid = provider.child.pid
            assert pid is not None
            async with trio.open_nursery() as nursery:
                replies: list[str] = []

                async def request() -> None:
                    replies.append(await ask(running, chat(long_question, max_tokens=4, temperature=0)))

                nursery.start_soon(request)
                await wait_until(lambda: provider.busy == 1)
                os.kill(pid, signal.SIGKILL)
            # A request is counted when its route line is written, after its last byte: wait for it.
            await route_lines.until(1)
            async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
                metrics = (await client.get("/metrics")).text
            stats = provider.statistics()
            # It is restarted, and admitted still (its model did not change).
            await provider.child.wait_state(ChildState.READY)
            assert provider.ready
    assert replies
    assert replies[0].strip()
    (line,) = route_lines.lines
    assert (line["route"], line["fallback"], line["outcome"]) == ("plain", "provider-failed", "ok")
    assert (line["provider"], line["engine"], line["device"]) == ("ov", "openvino", "CPU")
    assert (stats.jobs, stats.failures) == (1, 1)
    where = 'device="CPU",engine="openvino",kind="llama-server",provider="ov"'
    assert f"onebit_provider_failures_total{{{where}}} 1.0" in metrics
    assert 'onebit_requests_total{fallback="provider-failed",outcome="ok",route="plain"} 1.0' in metrics
    assert list((short_dir / "state").iterdir()) == []


def compiled(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under the compile cache: its size and modification time."""
    return {
        str(path.relative_to(directory)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in directory.rglob("*")
        if path.is_file()
    }


async def test_a_second_start_reuses_the_compile_cache_the_first_one_wrote(
    short_dir: Path, binary: Path, tmp_path: Path, route_lines: RouteLines
) -> None:
    cache = tmp_path / "openvino"
    with trio.fail_after(2 * START_S):
        async with run_daemon(openvino_config(short_dir, binary, compile_dir=cache), check_fidelity=False) as running:
            await admitted(running)
            await ask(running, chat(QUESTION, max_tokens=4, temperature=0))
        first = compiled(cache / "compiled")
        async with run_daemon(openvino_config(short_dir, binary, compile_dir=cache), check_fidelity=False) as running:
            await admitted(running)
            await ask(running, chat(QUESTION, max_tokens=4, temperature=0))
        second = compiled(cache / "compiled")
    assert first, f"the first start wrote nothing under {cache / 'compiled'}"
    # Nothing compiled again: every blob the second start used was the first one's, untouched.
    assert second == first
    assert [line["route"] for line in route_lines.lines] == ["file", "file"]


async def test_a_provider_over_the_fidelity_bound_is_refused_at_start_and_the_decoder_serves_plain(
    short_dir: Path,
    binary: Path,
    route_lines: RouteLines,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A bound no other engine meets: only a reply-identical KV passes it.
    monkeypatch.setattr(fidelity, "FACTOR", 0.0)
    monkeypatch.setattr(fidelity, "FLOOR", 0.0)
    caplog.set_level(logging.INFO, logger="onebit.provider")
    with trio.fail_after(START_S + 120):
        async with run_daemon(openvino_config(short_dir, binary)) as running:
            (provider,) = running.daemon.models.default.parts.providers.all
            assert isinstance(provider, LlamaServerProvider)
            await wait_until(lambda: provider.refused is not None)
            await provider.child.wait_state(ChildState.STOPPED)
            got = await ask(running, chat(QUESTION, max_tokens=8, temperature=0))
            stats = running.daemon.statistics()
    assert got.strip()
    (refusal,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert refusal.startswith(
        f"provider ov: refused for this model, the other providers go on: next-token TV distance over"
        f" {len(fidelity.GATE_PROMPTS)} prompts"
    )
    assert refusal.endswith("over the bound")
    (line,) = route_lines.lines
    assert (line["route"], line["fallback"], line["provider"]) == ("plain", "no-provider", None)
    (shown,) = stats.providers
    assert (shown.ready, shown.refused) == (False, provider.refused)


async def test_the_embedded_defaults_auto_engine_goes_on_with_ggml_when_openvino_is_refused(
    short_dir: Path, binary: Path, route_lines: RouteLines, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(openvino.BINARY_ENV, str(binary))
    monkeypatch.setattr(fidelity, "FACTOR", 0.0)  # no other engine meets it: OpenVINO is refused
    monkeypatch.setattr(fidelity, "FLOOR", 0.0)
    real_llama_server()
    shipped = (Path(__file__).parents[2] / "config" / "onebit.toml").read_text()
    config = make_config(
        short_dir,
        text=shipped,
        model={"parallel": 2, "ctx_size": 2048},
        decoder={"threads": 1},
        hybrid={"min_prompt_tokens": 16, **HANDOFF_ALWAYS},
        cache={"compile_dir": str(short_dir / "openvino")},
    )
    with trio.fail_after(START_S + 120):
        async with run_daemon(config) as running:
            (provider,) = running.daemon.models.default.parts.providers.all
            assert isinstance(provider, LlamaServerProvider)
            assert provider.engine == "openvino"
            await wait_until(lambda: provider.ready)
            got = await ask(running, chat(QUESTION, max_tokens=8, temperature=0))
    assert got.strip()
    assert (provider.engine, provider.device, provider.refused) == ("ggml", "CPU", None)
    (line,) = route_lines.lines
    assert (line["route"], line["fallback"], line["engine"], line["device"]) == ("file", None, "ggml", "CPU")
