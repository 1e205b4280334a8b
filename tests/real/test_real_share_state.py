"""The share route per family, proven by its state (issue 53, items 3 and 5): the patched llama-server
lends a slot's KV cache, and a hybrid model's recurrent or convolution state beside it; the llama-server
provider writes its saved rows into them; the decoder adopts them.  On the tiny models:

    route    a raw prompt and a chat, through onebitd: the share route with no fallback, the decoder
             evaluating one token of the raw prompt and at most the generation prompt and one of the chat
    state    the decoder's slot after the adopt, saved, against its own slot after it prefilled the same
             tokens: every part, every layer, relative error (supervisor/llama/statediff.py)
    logits   the decoder's next-token log-probabilities after the adopt against its own cached path

The provider runs the decoder's own engine, so both must match within float noise (as on the file route:
tests/real/test_real_state_fidelity.py).  Both comparisons are shown to catch a state one position off,
handed over through the share route itself: the tokens less one, and the tokens rotated by one (each
position its neighbour's token), flag, and so do the next-token logits after restoring the rotated
state under the real tokens' names (that file's ``assert_one_position_off_is_flagged``).  LFM2 with its
sliding window keeps the share route refused, the layout named.  Both regions a hybrid decoder lends
arrive sealed against resizing; one that keeps rollback snapshots for speculative decoding
(``--spec-type draft-eagle3``, which needs no draft model to set them) refuses to lend at all.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import httpx
import pytest
import trio

from supervisor.config import Config
from supervisor.llama import decoder, statediff, statefile
from supervisor.testing import unix_transport
from tests.real.test_real_families import model_file, tiny_models  # noqa: F401  (a fixture, and where each model is)
from tests.real.test_real_share import Decoder as ShareDecoder
from tests.real.test_real_share import assert_sealed, open_decoder
from tests.real.test_real_state_fidelity import (
    GGML_LOGITS,
    GGML_STATE,
    PROMPT,
    Decoder,
    Proof,
    assert_one_position_off_is_flagged,
    logits_error,
    relabelled,
)
from tests.rigs.rig import HANDOFF_ALWAYS, RouteLines, make_config, real_llama_server, run_daemon

pytestmark = pytest.mark.real

log = logging.getLogger("tests.share_state")

DEADLINE_S = 300
# The hybrid families whose memory the decoder lends (a KV cache beside a recurrent memory), and a dense
# one beside them.
LENT = ["qwen35-dense", "granitehybrid-dense", "lfm2-noswa-dense", "llama-dense"]
# A chat's generation prompt on the tiny models' templates: a handful of tokens (test_real_families.py).
GENERATION_PROMPT_MAX = 8


# llama.cpp's common sets n_rs_seq (rollback snapshots of the recurrent state per sequence) from these
# speculative types alone; draft-eagle3 asks for no model of its own where none is given.
ROLLBACK_ARGS = ("--spec-type", "draft-eagle3")


def config(runtime: Path, model_path: Path, *, decoder_args: tuple[str, ...] = ()) -> Config:
    real_llama_server()
    return make_config(
        runtime,
        model={"path": str(model_path), "parallel": 1, "ctx_size": 1024},
        decoder={"threads": 1, "extra_args": list(decoder_args)},
        cache={"dir": str(runtime / "store"), "ram_mib": 0},
        hybrid={"enabled": True, "min_prompt_tokens": 16, "mode": "share", **HANDOFF_ALWAYS},
        provider=[{"kind": "llama-server", "name": "p0", "threads": 1}],
    )


@pytest.mark.parametrize("name", LENT)
async def test_the_adopted_state_and_the_next_token_after_it_are_the_decoders_own(
    short_dir: Path,
    tiny_models: Path,  # noqa: F811
    route_lines: RouteLines,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
) -> None:
    monkeypatch.delenv("ONEBIT_KV_SHARE", raising=False)
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config(short_dir, model_file(tiny_models, name)), providers_ready=True) as running:
            model = running.daemon.models.default
            (provider,) = model.parts.providers.all
            await provider.wait_settled()
            assert model.parts.hybrid is not None
            share = model.parts.hybrid.share
            assert share is not None
            dec = Decoder(model.client, model.parts.state_dir)
            tokens = await decoder.tokenize(model.client, PROMPT)
            # What the share route hands over of a raw prompt: all of it, or less its last token where
            # the state cannot be cut back (a hybrid's).
            capability = model.parts.capability
            handed = capability.handed_over(tokens, None)

            async def adopt(over: list[int]) -> None:
                """``over`` handed over through the share route into the emptied slot and adopted (the
                job, a hybrid's with the token after them that the share route leaves out)."""
                assert await decoder.erase(model.client, 0) is None
                job = over + tokens[len(over) :][: capability.short_by]
                assert capability.handed_over(job, None) == over
                generation = model.parts.decoder.generation
                outcome = await share.run(
                    req="proof", slot=0, tokens=job, provider=provider, generation=generation, timeout_s=120
                )
                assert outcome.ok, outcome

            async def adopted_as(over: list[int], name: str) -> Path:
                """The slot's state after ``over`` was adopted, saved as ``name``."""
                await adopt(over)
                saved = await decoder.save(model.client, 0, name)
                assert isinstance(saved, decoder.Saved), saved
                return model.parts.state_dir / name

            adopted = statefile.read(await adopted_as(handed, "adopted.state"))
            own_path = await dec.own_state(handed, "own.state")
            own = statefile.read(own_path)
            cached = await dec.next(tokens, evaluated=len(tokens) - len(handed) or 1)
            await adopt(handed)
            after = await dec.next(tokens, evaluated=len(tokens) - len(handed) or 1)
            # One position off, handed over through the share route: short by one, and rotated by one.
            short = statefile.read(await adopted_as(handed[:-1], "short.state"))
            rotated_path = await adopted_as(handed[1:] + handed[:1], "rotated.state")
            rotated = statefile.read(rotated_path)
            forged = relabelled(rotated_path, own_path, model.parts.state_dir / "forged.state")
            after_forged = await dec.next_after_restore(forged, len(handed), tokens)

            # Through onebitd: a raw prompt, then a chat.
            async with httpx.AsyncClient(base_url=running.url, timeout=120) as client:
                raw = await client.post("/completion", json={"prompt": PROMPT, "n_predict": 2, "temperature": 0})
                assert raw.status_code == 200, raw.text
                chat = await client.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, "temperature": 0},
                )
                assert chat.status_code == 200, chat.text
            first, second = await route_lines.until(2)

    comparison = statediff.compare(adopted, own)
    worst = " ".join(f"{t} {comparison.worst(t):.2e}" for t in "KVRS")
    log.warning("%s share: state %s, logits %.2e", name, worst, logits_error(after, cached))
    assert comparison.differences == (), comparison
    assert comparison.max_error <= GGML_STATE, comparison
    if name != "llama-dense":
        assert adopted.recurrent is not None
        assert {e.part for e in comparison.errors} >= {"recurrent"}, comparison.errors
    assert logits_error(after, cached) <= GGML_LOGITS
    assert after.ranked[0] == cached.ranked[0]
    proof = Proof(
        state=comparison,
        logits=logits_error(after, cached),
        same_top1=after.ranked[0] == cached.ranked[0],
        short=statediff.compare(short, own),
        rotated=statediff.compare(rotated, own),
        rotated_logits=logits_error(after_forged, cached),
    )
    assert_one_position_off_is_flagged(proof, state_bound=GGML_STATE, logits_bound=GGML_LOGITS)
    for line in (first, second):
        assert (line["route"], line["fallback"], line["outcome"]) == ("share", None, "ok"), line
    assert first["decoder_prompt_n"] == 1, first
    assert 0 < second["decoder_prompt_n"] <= GENERATION_PROMPT_MAX + 1, second


async def test_a_hybrid_decoder_lends_both_regions_sealed_and_none_beside_rollback_snapshots(
    short_dir: Path,
    tiny_models: Path,  # noqa: F811
) -> None:
    path = model_file(tiny_models, "qwen35-dense")
    with trio.fail_after(DEADLINE_S):
        process, sock = await open_decoder(short_dir, model=path)
        try:
            async with httpx.AsyncClient(transport=unix_transport(sock), base_url="http://d", timeout=60) as client:
                header, fds = await ShareDecoder(short_dir, client).share(0, 4)
                try:
                    assert [region.get("state", False) for region in header["regions"]] == [False, True]
                    assert len(fds) == 2
                    for fd in fds:
                        assert_sealed(fd)
                finally:
                    for fd in fds:
                        os.close(fd)
        finally:
            process.kill()
            await process.wait()

        again = short_dir / "r"  # a directory of its own: the first server's socket file is still there
        again.mkdir()
        process, sock = await open_decoder(again, model=path, args=ROLLBACK_ARGS)
        try:
            async with httpx.AsyncClient(transport=unix_transport(sock), base_url="http://d", timeout=60) as client:
                status, data = await ShareDecoder(again, client).post(
                    "/slots/0?action=share", {"socket": str(again / "nobody.sock"), "n_tokens": 4}
                )
        finally:
            process.kill()
            await process.wait()
    assert status == 400, data
    assert data["error"]["message"].startswith("This server cannot share its KV: the recurrent memory keeps ")
    assert "rollback snapshots per sequence for speculative decoding" in data["error"]["message"]


async def test_a_hybrid_decoder_with_rollback_snapshots_sends_requests_to_the_file_route_saying_why(
    short_dir: Path,
    tiny_models: Path,  # noqa: F811
    route_lines: RouteLines,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ONEBIT_KV_SHARE", raising=False)
    path = model_file(tiny_models, "qwen35-dense")
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config(short_dir, path, decoder_args=ROLLBACK_ARGS), providers_ready=True) as running:
            async with httpx.AsyncClient(base_url=running.url, timeout=120) as client:
                raw = await client.post("/completion", json={"prompt": PROMPT, "n_predict": 2, "temperature": 0})
                assert raw.status_code == 200, raw.text
                refused = (await client.get("/health")).json().get("share_refused", {})
            (line,) = await route_lines.until(1)
            model = running.daemon.models.default.name
    assert (line["route"], line["fallback"], line["memory"]) == ("file", "share-refused", "kv+recurrent"), line
    assert "rollback snapshots" in refused[model], refused
