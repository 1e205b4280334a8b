"""A request's story, in process: ``Front`` and ``Completions`` against tests/fakes/llama/inprocess.py (an httpx
transport) and an in-test provider, driven through the ASGI interface the way the server drives it.

What only these tests can show without a process: the fallback chain keeps every reason in order,
the walk follows ``DEGRADE``, and what a request does after its last byte is not cancelled by the
disconnect the server reports once a response has finished.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing

from supervisor.api.front import Front
from supervisor.api.serving import One
from supervisor.config import HybridConfig, ServerConfig
from supervisor.llama.llama_server import StateFingerprint
from supervisor.llama.slots import PromptKey, SlotPool
from supervisor.prefix.store import PrefixStore
from supervisor.providers import Provider, Providers
from supervisor.routeline import RouteLine
from supervisor.routes.completion import Completions, Hybrid
from supervisor.routes.contention import DECODER
from supervisor.routes.decision import DEGRADE, Step
from supervisor.routes.file import FileHandoff
from supervisor.routes.plan import Plan, plan_with
from supervisor.routes.prompt import Prompt
from supervisor.routes.share import ShareHandoff, ShareHandshake
from supervisor.routes.stored import StoredPrefixes
from supervisor.supervise.child import ChildState
from tests.fakes.llama.core import Modes
from tests.fakes.llama.inprocess import Events, FakeLlama, HttpxWire
from tests.rigs import asgi
from tests.rigs.asgi import ReadyDecoder, Reply
from tests.rigs.helpers import wait_until
from tests.rigs.rig import ScriptedProvider, own_cores
from tests.unit.prefix.test_prefix_store import private_store

TIMEOUT = 10
PROMPT = "the quick brown fox jumps over the lazy dog"
M = len(PROMPT.split())
KEPT = M - 1  # a raw prompt's store entry ends a token short (routes/boundary.py's entry_end)
SETTINGS = HybridConfig(enabled=True, min_prompt_tokens=4)
# The prefix store's entries are made under this (any value: the fake decoder has no parameters).
FINGERPRINT = StateFingerprint(
    model_path="/models/fake.gguf",
    model_size=1,
    model_mtime_ns=1,
    model_head_sha256="ab" * 32,
    server_version="version: 1 (test)",
    ctx_size=4096,
    parallel=2,
    batch_size=2048,
    ubatch_size=512,
    cache_type_k="f16",
    cache_type_v="f16",
    extra_args=(),
)


@attrs.define
class Rig:
    fake: FakeLlama
    completions: Completions
    front: Front
    lines: list[RouteLine]

    async def post(self, path: str, body: dict[str, Any]) -> Reply:
        """One request, and the client hanging up right after the reply (tests/rigs/asgi.py)."""
        return await asgi.call(self.front, "POST", path, body)


def make_rig(
    tmp_path: Path,
    provider: Provider,
    *,
    share: bool = False,
    slot_context: int | None = None,
    prompt_cache_mib: int = 0,
) -> Rig:
    fake = FakeLlama(tmp_path)
    client = fake.client()
    share_handoff = None
    if share:
        handshake = ShareHandshake(client=client, runtime_dir=tmp_path, connect_timeout_s=1.0)
        share_handoff = ShareHandoff(client=client, handshake=handshake, model="fake-model", n_ctx=4096)
    hybrid = Hybrid(
        providers=Providers([provider]),
        file=FileHandoff(client=client, state_dir=tmp_path, model="fake-model", n_ctx=4096),
        share=share_handoff,
        placement=own_cores(provider.name),
    )
    decoder = ReadyDecoder()
    completions = Completions(
        decoder=decoder,
        client=client,
        slots=SlotPool(2, 8),
        settings=SETTINGS,
        hybrid=hybrid,
        slot_context=slot_context,
        prompt_cache_mib=prompt_cache_mib,
    )
    lines: list[RouteLine] = []
    front = Front(ServerConfig(), One(completions, client, decoder), emit=lines.append)
    return Rig(fake, completions, front, lines)


@asynccontextmanager
async def serving_with_store(
    rig: Rig, tmp_path: Path, fingerprint: StateFingerprint = FINGERPRINT
) -> AsyncIterator[PrefixStore]:
    """The rig's completions running with a prefix store of their own (``tmp_path/store``, which
    knows the model's capability) for the block's requests; stopped, and the store closed, when the
    block ends."""
    store = await private_store(tmp_path / "store", fingerprint=fingerprint, max_bytes=1 << 20, min_tokens=4)
    capability = rig.completions.capability
    stored = StoredPrefixes(client=rig.completions.client, state_dir=tmp_path, store=store, capability=capability)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(rig.completions.run, stored)
            yield store
            nursery.cancel_scope.cancel()
    finally:
        store.close()


def restart_decoder(rig: Rig) -> None:
    """The decoder restarted: its slots hold nothing, and onebitd knows it."""
    rig.fake.core.empty()
    rig.completions.decoder.generation += 1  # type: ignore[misc]


def body_for(stream: bool) -> dict[str, Any]:
    return {"prompt": PROMPT, "n_predict": 3, "stream": stream}


def state_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.state"))


def hybrid_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "onebit.hybrid" and r.levelno >= logging.WARNING]


@pytest.fixture(autouse=True)
def _hybrid_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="onebit.hybrid")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_the_file_route_hands_the_prompt_over_and_the_decoder_evaluates_one_token(
    tmp_path: Path, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    rig = make_rig(tmp_path, ScriptedProvider())
    with trio.fail_after(TIMEOUT):
        reply = await rig.post("/completion", body_for(stream))
    assert reply.status == 200
    [line] = rig.lines
    assert (line.route, line.fallback, line.prompt_tokens, line.decoder_prompt_n) == ("file", None, M, 1)
    assert (line.prefill_ms, line.outcome, line.status) == (7.25, "ok", 200)
    assert rig.fake.actions == [("restore", 0)]
    assert state_files(tmp_path) == []
    assert hybrid_warnings(caplog) == []


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_restore_the_decoder_did_not_use_is_warned_counted_and_chained_though_the_client_hung_up(
    tmp_path: Path, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    rig = make_rig(tmp_path, ScriptedProvider())
    rig.fake.modes = Modes(restore_unused=True)
    with trio.fail_after(TIMEOUT):
        reply = await rig.post("/completion", body_for(stream))
    assert reply.status == 200
    [line] = rig.lines
    assert (line.route, line.fallback, line.decoder_prompt_n, line.outcome) == ("file", "restore-unused", M, "ok")
    assert rig.completions.restore_unused == 1
    assert hybrid_warnings(caplog) == [
        f"hybrid: restore was not used by the decoder: it evaluated {M} of {M} prompt tokens ({line.req})"
    ]


async def test_the_fallback_keeps_every_reason_in_order(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The stock decoder refuses to share (the file route follows), then the provider fails (plain).
    rig = make_rig(tmp_path, ScriptedProvider(error="the NPU is on fire"), share=True)
    with trio.fail_after(TIMEOUT):
        reply = await rig.post("/completion", body_for(False))
    assert reply.status == 200
    [line] = rig.lines
    assert (line.route, line.fallback, line.decoder_prompt_n) == ("plain", "share-refused>provider-failed", M)
    [refused, failed] = hybrid_warnings(caplog)
    assert refused.startswith("hybrid: share answered 400: ")
    assert refused.endswith("; this decoder cannot share its KV; the state-file route is used")
    assert failed == "hybrid: provider failed: the NPU is on fire; the backend prefills this request itself"


Scenario = Callable[[Rig], Awaitable[None]]


async def _refuse_restores(rig: Rig) -> None:
    rig.fake.modes = Modes(restore_refuse=True)


async def _nothing(rig: Rig) -> None:
    pass


@pytest.mark.parametrize(
    ("provider", "setup", "step", "fallback"),
    [
        (ScriptedProvider(error="boom"), _nothing, Step.FILE_PREFILL, "provider-failed"),
        (ScriptedProvider(write_file=False), _nothing, Step.FILE_PREFILL, "provider-failed"),
        (ScriptedProvider(), _refuse_restores, Step.RESTORE, "restore-refused"),
    ],
    ids=["provider-error", "no-state-file", "restore-refused"],
)
async def test_a_failed_file_route_goes_where_degrade_says(
    tmp_path: Path, provider: ScriptedProvider, setup: Scenario, step: Step, fallback: str
) -> None:
    rig = make_rig(tmp_path, provider)
    await setup(rig)
    with trio.fail_after(TIMEOUT):
        reply = await rig.post("/completion", body_for(True))
    assert reply.status == 200
    [line] = rig.lines
    assert (line.route, line.fallback) == (DEGRADE[step].value, fallback)
    assert line.decoder_prompt_n == M  # the decoder prefilled it itself, once
    assert state_files(tmp_path) == []


async def test_a_reload_swaps_the_settings_for_the_next_request_only(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, ScriptedProvider())
    with trio.fail_after(TIMEOUT):
        await rig.post("/completion", body_for(False))
        rig.completions.configure(attrs.evolve(SETTINGS, min_prompt_tokens=M + 1))
        await rig.post("/completion", {**body_for(False), "prompt": PROMPT.upper()})
    first, second = rig.lines
    assert (first.route, first.fallback) == ("file", None)
    assert (second.route, second.fallback) == ("plain", "short-prompt")
    assert SETTINGS.min_prompt_tokens == 4  # the old value was swapped out, not changed


async def test_a_restarted_decoder_is_not_taken_to_hold_what_its_slots_held(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, ScriptedProvider())
    # Whatever the fake's tiny timings teach the rates, a prompt the slot lacks is handed over.
    rig.completions.configure(attrs.evolve(SETTINGS, prefer_margin=1e9))
    body = body_for(False)
    with trio.fail_after(TIMEOUT):
        await rig.post("/completion", body)  # handed over: the slot holds the prompt
        await rig.post("/completion", body)  # the same prompt: the slot holds it, so plain
        decoder = rig.completions.decoder
        assert isinstance(decoder, ReadyDecoder)
        decoder.generation += 1  # a new decoder process, with empty slots
        rig.fake.core.empty()
        await rig.post("/completion", body)
    first, second, third = rig.lines
    assert [(line.route, line.fallback) for line in (first, second)] == [("file", None), ("plain", "cached")]
    assert (third.route, third.fallback, third.decoder_prompt_n) == ("file", None, 1)


# -- what the route line says of a stream's end, and of its times ------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "final"),
    [
        pytest.param(
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "stream": True},
            b"[DONE]",
            id="openai-done",
        ),
        pytest.param("/completion", body_for(True), b'"stop":true', id="llama-stop"),
        pytest.param(
            "/v1/messages",
            {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "stream": True},
            b"message_stop",
            id="anthropic-message-stop",
        ),
    ],
)
async def test_a_stream_whose_client_closes_on_its_final_event_is_ok(
    tmp_path: Path, path: str, body: dict[str, Any], final: bytes
) -> None:
    # The README's openai example: the client reads data: [DONE] and closes at once, before the end
    # of the chunked body.
    rig = make_rig(tmp_path, ScriptedProvider())
    with trio.fail_after(TIMEOUT):
        reply = await asgi.call(rig.front, "POST", path, body, hang_up_on=final)
    assert reply.status == 200
    assert final in reply.body
    [line] = rig.lines
    assert (line.outcome, line.status, line.error) == ("ok", 200, None)


async def test_a_stream_whose_client_closes_before_its_final_event_is_cancelled(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, ScriptedProvider())
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "stream": True}
    with trio.fail_after(TIMEOUT):
        await asgi.call(rig.front, "POST", "/v1/chat/completions", body, hang_up_on=b'"the"')
    [line] = rig.lines
    assert line.outcome == "cancelled"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_first_byte_and_total_count_from_the_same_arrival(
    tmp_path: Path, stream: bool, autojump_clock: trio.testing.MockClock
) -> None:
    # A body that comes a second after its head: both times count from the head.
    rig = make_rig(tmp_path, ScriptedProvider())
    with trio.fail_after(TIMEOUT):
        reply = await asgi.call(rig.front, "POST", "/completion", body_for(stream), body_after_s=1.0)
    assert reply.status == 200
    [line] = rig.lines
    assert line.first_byte_ms is not None
    assert line.total_ms is not None
    assert line.first_byte_ms >= 1000
    assert line.total_ms >= line.first_byte_ms


async def test_a_prompt_over_a_slots_context_gets_the_decoders_400_with_no_handoff_and_no_slot_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    provider = ScriptedProvider()
    rig = make_rig(tmp_path, provider, slot_context=M)  # PROMPT has M tokens: no room for a reply
    rig.fake.with_slot_context(M)
    # Every prompt over the floor is handed over (no cost decision): so is the one that fits.
    rig.completions.configure(attrs.evolve(SETTINGS, route_by="length"))
    with trio.fail_after(TIMEOUT):
        fits = await rig.post("/completion", {"prompt": "one two three four five", "n_predict": 1})
        held = [rig.completions.slots.holds(slot) for slot in range(2)]
        refused = [await rig.post("/completion", body_for(False)) for _ in range(2)]
    assert fits.status == 200
    for reply in refused:
        assert reply.status == 400
        assert reply.headers["x-onebit-source"] == "decoder"
        assert reply.json()["error"]["type"] == "exceed_context_size_error"
    assert len(provider.jobs) == 1  # the prompt that fitted
    for line in rig.lines[1:]:
        assert (line.route, line.fallback, line.outcome, line.prompt_tokens) == ("plain", "over-context", "error", M)
        assert line.error is not None
        assert "exceeds the available context size" in line.error
    assert [rig.completions.slots.holds(slot) for slot in range(2)] == held
    assert hybrid_warnings(caplog) == []
    assert [action for action, _slot in rig.fake.actions] == ["restore"]  # the prompt that fitted


# -- the prefix store keeps a prompt whose client hung up mid-stream ----------------------------------


async def test_a_stream_hung_up_after_its_first_token_keeps_its_prompt_in_the_prefix_store(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, ScriptedProvider())
    rig.fake.modes = Modes(hold=True)  # the reply pauses after its first token: the client leaves then
    with trio.fail_after(TIMEOUT):
        async with serving_with_store(rig, tmp_path) as store:
            await asgi.call(rig.front, "POST", "/completion", body_for(True), hang_up_on=b'"stop":false')
            # The put runs off the request's path, its writes in a thread.
            await wait_until(lambda: store.statistics().stores == 1)
    [line] = rig.lines
    assert line.outcome == "cancelled"
    assert ("save", line.slot) in rig.fake.actions
    entry = store.lookup(FakeLlama.tokenize(PROMPT))
    assert entry is not None
    assert entry.n_tokens == M


# -- words, and a route line that says what happened ---------------------------------------------------


@pytest.mark.parametrize(
    ("state", "words"),
    [
        (ChildState.BACKOFF, "the decoder is restarting after a crash; try again shortly"),
        (ChildState.STARTING, "the decoder is starting (loading its model); try again shortly"),
    ],
)
async def test_a_503_while_the_decoder_is_not_ready_says_so_in_words(
    tmp_path: Path, state: ChildState, words: str
) -> None:
    rig = make_rig(tmp_path, ScriptedProvider())
    rig.completions.decoder.state = state  # type: ignore[misc]
    with trio.fail_after(TIMEOUT):
        reply = await rig.post("/completion", body_for(False))
    assert reply.status == 503
    assert reply.json()["error"]["message"] == words


async def test_a_decoder_that_cannot_be_reached_is_a_503_without_its_socket_or_errno(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, ScriptedProvider())

    async def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused: /run/onebit/decoder.sock")

    rig.completions.client._transport = HttpxWire(httpx.MockTransport(refuse))
    with trio.fail_after(TIMEOUT):
        reply = await rig.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert reply.status == 503
    message = reply.json()["error"]["message"]
    assert message == "the decoder could not be reached (it may be restarting); try again shortly"
    [line] = rig.lines
    assert line.error is not None
    assert "Errno 111" in line.error  # the operator's line keeps what happened


async def test_a_client_that_leaves_during_the_providers_prefill_is_logged_on_the_route_it_was_taking(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    provider = ScriptedProvider(prefill_s=10.0)
    rig = make_rig(tmp_path, provider)
    rig.completions.configure(attrs.evolve(SETTINGS, route_by="length"))
    with trio.fail_after(TIMEOUT):
        reply = await asgi.call(rig.front, "POST", "/completion", body_for(False), hang_up_after_s=1.0)
    assert reply.status == 0
    [line] = rig.lines
    assert (line.route, line.outcome, line.status) == ("file", "cancelled", 499)
    assert len(provider.jobs) == 1
    assert line.prefill_ms >= 1000  # it ran until the client left
    assert state_files(tmp_path) == []


async def test_a_prompt_restored_from_the_store_says_stored_and_its_restore_time(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, ScriptedProvider(ready=False))  # as at start: no provider ready yet
    with trio.fail_after(TIMEOUT):
        async with serving_with_store(rig, tmp_path) as store:
            first = await rig.post("/completion", body_for(False))
            # The put runs off the request's path, its writes in a thread.
            await wait_until(lambda: store.statistics().stores == 1)
            restart_decoder(rig)
            again = await rig.post("/completion", body_for(False))
    assert first.status == again.status == 200
    cold, warm = rig.lines
    assert (cold.fallback, cold.restored_tokens, cold.restore_ms) == ("no-provider", None, 0)
    assert (warm.fallback, warm.restored_tokens) == ("no-provider>stored", KEPT)
    assert warm.restore_ms > 0


async def test_a_stored_prefix_whose_state_file_was_damaged_is_not_restored_and_the_request_prefills(
    tmp_path: Path,
) -> None:
    rig = make_rig(tmp_path, ScriptedProvider(ready=False))
    with trio.fail_after(TIMEOUT):
        async with serving_with_store(rig, tmp_path) as store:
            first = await rig.post("/completion", body_for(False))
            await wait_until(lambda: store.statistics().stores == 1)
            [entry] = store.list()
            state = store.io.state_path(entry.key)
            # Another first token, the size and the magic as they were: a restore would give the
            # slot state the prompt never had; only the content hash tells.
            damaged = bytearray(state.read_bytes())
            at = damaged.index(b'"tokens": [') + len(b'"tokens": [')
            damaged[at] = ord("8") if damaged[at] == ord("9") else ord("9")
            state.write_bytes(bytes(damaged))
            restart_decoder(rig)
            again = await rig.post("/completion", body_for(False))
            assert store.statistics().entries == 0
    assert first.status == again.status == 200
    cold, warm = rig.lines
    assert (warm.fallback, warm.restored_tokens, warm.decoder_prompt_n) == (cold.fallback, None, M)


async def test_a_next_turn_sent_while_its_slot_is_saved_for_the_store_waits_for_that_slot(tmp_path: Path) -> None:
    # An agent sends its next turn the moment a reply ends, while onebitd still holds the slot to
    # save it for the prefix store; the other slot is free, and holds nothing of the conversation.
    rig = make_rig(tmp_path, ScriptedProvider(ready=False))
    rig.fake.modes = Modes(hold_save=True)
    # Long enough for slot affinity to count the shared prefix as a conversation (slots.USEFUL_TOKENS).
    turn1 = {**body_for(False), "prompt": f"{PROMPT} {PROMPT}"}
    turn2 = {**turn1, "prompt": f"{PROMPT} {PROMPT} and then a second question"}
    with trio.fail_after(TIMEOUT):
        async with serving_with_store(rig, tmp_path), trio.open_nursery() as turns:
            turns.start_soon(rig.post, "/completion", turn1)
            await wait_until(lambda: [r["event"] for r in rig.fake.records].count("save-held") == 1)
            turns.start_soon(rig.post, "/completion", turn2)
            await wait_until(lambda: rig.completions.slots.statistics().keep_waiting == 1)
            rig.fake.release.set()
    first, second = rig.lines
    assert second.slot == first.slot
    assert rig.completions.slots.statistics().keep_waits == 1


async def test_a_stream_the_decoder_drops_mid_way_is_a_warning_and_an_error_event(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig = make_rig(tmp_path, ScriptedProvider())

    async def dropped() -> AsyncGenerator[bytes, None]:
        yield b'data: {"content": "the", "stop": false}\n\n'
        raise httpx.ReadError("connection reset by peer")

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/completion":
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Events(dropped()))
        return await rig.fake.handle(request)

    rig.completions.client._transport = HttpxWire(httpx.MockTransport(handle))
    with trio.fail_after(TIMEOUT):
        reply = await rig.post("/completion", body_for(True))
    assert reply.status == 200
    assert b'"code": "decoder_lost"' in reply.body
    [line] = rig.lines
    assert line.outcome == "error"
    assert hybrid_warnings(caplog) == [f"{line.req}: the decoder stopped mid-stream: {line.error}"]


@pytest.mark.parametrize("unused", [False, True], ids=["used", "unused"])
async def test_an_anthropic_message_restored_from_the_store_is_counted_when_the_decoder_leaves_it_unused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, unused: bool
) -> None:
    rig = make_rig(tmp_path, ScriptedProvider(ready=False))
    body = {"system": "You are terse.", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3}
    with trio.fail_after(TIMEOUT):
        async with serving_with_store(rig, tmp_path) as store:
            first = await rig.post("/v1/messages", body)
            await wait_until(lambda: store.statistics().stores == 1)
            restart_decoder(rig)
            rig.fake.modes = Modes(restore_unused=unused)
            again = await rig.post("/v1/messages", body)
    assert first.status == again.status == 200
    cold, warm = rig.lines
    assert cold.prompt_tokens is not None
    # Its entry ends before the generation prompt (one token here).
    assert warm.restored_tokens is not None
    assert warm.restored_tokens + 1 == cold.prompt_tokens == warm.prompt_tokens
    # A restore the decoder did not use is said on the route line, as a handoff's is.
    assert warm.fallback == ("no-provider>stored>restore-unused" if unused else "no-provider>stored")
    assert rig.completions.restore_unused == (1 if unused else 0)
    assert warm.cached_tokens == (0 if unused else cold.prompt_tokens - 1)
    warned = [r.getMessage() for r in caplog.records if "did not use the restored prefix" in r.getMessage()]
    assert len(warned) == (1 if unused else 0)


async def test_in_cost_mode_a_prompt_the_store_restored_is_not_handed_over_to_spare_the_streams(
    tmp_path: Path,
) -> None:
    # The case: 769 tokens restored from the store, 36-43 new, streams decoding, and plain's estimate
    # past max_stall_ms: the handoff overwrote the restore and prefilled the whole prompt again.
    # Here the stored prompt and 12 new words (more than it: the rates are the priors, unsure, and an
    # unsure estimate alone keeps plain a prompt the slot holds most of), two streams decoding and
    # max_stall_ms 0: a handoff is taken after a restore only when it is cheaper than the decoder's
    # evaluating the rest, and it is not.
    rig = make_rig(tmp_path, ScriptedProvider())
    new = " and runs far away into the woods where no dog has ever found it"
    more = {**body_for(False), "prompt": PROMPT + new}
    with trio.fail_after(TIMEOUT):
        async with serving_with_store(rig, tmp_path) as store:
            await rig.post("/completion", body_for(False))
            await wait_until(lambda: store.statistics().stores == 1)
            restart_decoder(rig)
            rig.completions.configure(attrs.evolve(SETTINGS, max_stall_ms=0.0))
            rig.completions.decoding += 2  # two other requests' replies being decoded meanwhile
            restored = await rig.post("/completion", more)
            rig.completions.decoding -= 2
    assert restored.status == 200
    first, line = rig.lines
    assert first.route == "file"
    assert (line.route, line.fallback, line.restored_tokens) == ("plain", "plain-cheaper>stored", KEPT)
    assert line.decoder_prompt_n == len(new.split())  # the new words, on top of what the store restored
    assert line.est_plain_ms is not None
    assert line.est_hybrid_ms is not None
    assert line.est_plain_ms < line.est_hybrid_ms


async def test_with_route_by_length_a_handed_over_prompt_restores_nothing_from_the_store(tmp_path: Path) -> None:
    # The handoff's state would overwrite whatever the store restored into the slot: the restore is
    # not made (it was, and wasted its time, before); a prompt kept plain still gets it.
    rig = make_rig(tmp_path, ScriptedProvider())
    rig.completions.configure(attrs.evolve(SETTINGS, route_by="length"))
    with trio.fail_after(TIMEOUT):
        async with serving_with_store(rig, tmp_path) as store:
            first = await rig.post("/completion", body_for(False))
            await wait_until(lambda: store.statistics().stores == 1)
            restart_decoder(rig)
            rig.fake.records.clear()
            handed = await rig.post("/completion", body_for(False))
            assert store.statistics().restores == 0
            # Kept plain (its prompt under the floor): the store serves it.
            restart_decoder(rig)
            rig.completions.configure(attrs.evolve(SETTINGS, route_by="length", min_prompt_tokens=10_000))
            plain = await rig.post("/completion", body_for(False))
    assert first.status == handed.status == plain.status == 200
    _, file_line, plain_line = rig.lines
    assert (file_line.route, file_line.fallback, file_line.restored_tokens) == ("file", None, None)
    # The handoff's restore, then the plain request's restore from the store; none before the handoff.
    assert [action[0] for action in rig.fake.actions if action[0] == "restore"] == ["restore", "restore"]
    assert store.statistics().restores == 1
    assert (plain_line.route, plain_line.fallback, plain_line.restored_tokens) == ("plain", "short-prompt>stored", KEPT)


async def test_a_request_that_comes_while_another_is_prefilled_counts_that_prefill_in_its_estimate(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # The same prompt twice, the second sent while the provider still prefills the first: the
    # provider batches or queues the two, so the second's hybrid estimate adds what the first has left.
    provider = ScriptedProvider(prefill_s=3.0)
    rig = make_rig(tmp_path, provider)
    contention = rig.completions.contention
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rig.post, "/completion", body_for(False))
            await wait_until(lambda: len(provider.jobs) == 1)
            assert contention.tokens(provider.name) == M
            await rig.post("/completion", body_for(False))
    first, second = sorted(rig.lines, key=lambda line: line.req)
    assert first.est_hybrid_ms is not None
    assert second.est_hybrid_ms is not None
    assert second.est_hybrid_ms > first.est_hybrid_ms
    assert (contention.tokens(provider.name), contention.tokens(DECODER)) == (0, 0)


async def test_a_request_cancelled_during_its_prefill_leaves_nothing_in_flight(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    provider = ScriptedProvider(prefill_s=10.0)
    rig = make_rig(tmp_path, provider)
    with trio.fail_after(TIMEOUT):
        reply = await asgi.call(rig.front, "POST", "/completion", body_for(False), hang_up_after_s=1.0)
    assert reply.status == 0
    [line] = rig.lines
    assert (line.route, line.outcome) == ("file", "cancelled")
    assert (rig.completions.contention.tokens(provider.name), rig.completions.contention.tokens(DECODER)) == (0, 0)


# A prompt long enough that a question on it leaves its slot holding most of it by its text.
LONG = " ".join(f"w{i:04d}" for i in range(200))
SYSTEM = {"role": "system", "content": LONG}


def asking(question: str) -> list[dict[str, str]]:
    """A question on the long system prompt: what an agent fleet sends."""
    return [SYSTEM, {"role": "user", "content": question}]


def sent(rig: Rig, path: str, text: str) -> int:
    """Where, among the requests the decoder got, the first to ``path`` for ``text`` came."""
    for n, (seen_path, _, body) in enumerate(rig.fake.seen):
        if seen_path == path and text in (body.get("prompt"), body.get("content")):
            return n
    raise AssertionError(f"no {path} for {text!r}")


async def test_a_prompt_its_slot_holds_most_of_by_its_text_goes_to_the_decoder_before_it_is_tokenized(
    tmp_path: Path,
) -> None:
    # The fleet's second question on a system prompt: planning it first (a tokenize here, a template
    # and a tokenize for a chat) is time before its first token that llama-server direct never spends.
    rig = make_rig(tmp_path, ScriptedProvider())
    question = f"{LONG} and a question on it"
    with trio.fail_after(TIMEOUT):
        first = await rig.post("/completion", {"prompt": LONG, "n_predict": 2})
        second = await rig.post("/completion", {"prompt": question, "n_predict": 2})
    assert first.status == second.status == 200
    assert sent(rig, "/tokenize", LONG) < sent(rig, "/completion", LONG)  # a cold prompt: planned first
    assert sent(rig, "/completion", question) < sent(rig, "/tokenize", question)  # sent at once
    cold, line = rig.lines
    assert line.slot == cold.slot
    # Planned after its reply: the line holds its tokens' count and estimates priced on them.
    assert (line.route, line.fallback, line.prompt_tokens) == ("plain", "cached", 205)
    assert line.est_plain_ms is not None
    assert line.est_hybrid_ms is not None
    assert line.est_plain_ms < line.est_hybrid_ms
    # The slot is known by the prompt's tokens again: what a next request's estimate reads.
    assert rig.completions.slots.holds(line.slot or 0).tokens == tuple(rig.fake.tokenize(question))


@pytest.mark.parametrize("tools", [False, True], ids=["messages", "tools"])
async def test_a_chat_goes_at_once_only_where_its_messages_are_all_the_template_reads(
    tmp_path: Path, tools: bool
) -> None:
    rig = make_rig(tmp_path, ScriptedProvider())
    extra: dict[str, Any] = {}
    if tools:  # rendered into the prompt by most templates, and not in the messages' text
        extra = {"tools": [{"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}]}
    with trio.fail_after(TIMEOUT):
        for question in ("a first question", "a second question"):
            reply = await rig.post("/v1/chat/completions", {"messages": asking(question), "max_tokens": 2, **extra})
            assert reply.status == 200
    paths = [path for path, _, _ in rig.fake.seen if path in ("/apply-template", "/v1/chat/completions")]
    planned_first = ["/apply-template", "/v1/chat/completions"]
    assert paths[:2] == planned_first  # a slot that holds nothing: planned first
    assert paths[2:] == (planned_first if tools else ["/v1/chat/completions", "/apply-template"])
    assert rig.lines[1].prompt_tokens == rig.lines[0].prompt_tokens  # the same length, one word changed


async def test_a_prompt_whose_slot_was_taken_before_it_held_one_is_planned_in_the_slot_it_got(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = make_rig(tmp_path, ScriptedProvider())
    question = f"{LONG} and a question on it"
    completions = rig.completions
    slots = completions.slots
    with trio.fail_after(TIMEOUT):
        await rig.post("/completion", {"prompt": LONG, "n_predict": 2})
        held = rig.lines[0].slot or 0
        early, hold = completions._early, slots.hold
        guessed: list[object] = []

        def guessing(prompt: Prompt, settings: HybridConfig) -> object:
            guessed.append(early(prompt, settings))
            return guessed[-1]

        def hold_after_another(key: PromptKey | None = None, *, settle: Any = None) -> Any:
            # Between the guess and the hold another request held the slot and let it go: it holds
            # an equal prompt, a new one all the same (its own reply is in the cache now).
            slots._held[held] = attrs.evolve(slots._held[held])
            return hold(key, settle=settle)

        async def not_at_once(*args: object) -> None:
            raise AssertionError("sent at once on a slot that changed since it was guessed")

        monkeypatch.setattr(completions, "_early", guessing)
        monkeypatch.setattr(slots, "hold", hold_after_another)
        monkeypatch.setattr(completions, "_at_once", not_at_once)
        reply = await rig.post("/completion", {"prompt": question, "n_predict": 2})
    assert reply.status == 200
    assert guessed[-1] is not None  # guessed at once, on the slot it then held
    assert sent(rig, "/tokenize", question) < sent(rig, "/completion", question)
    line = rig.lines[1]
    assert line.slot == held  # planned in the slot it got
    assert line.prompt_tokens == 205
    assert slots.holds(held).tokens == tuple(rig.fake.tokenize(question))


async def test_a_next_turn_sent_while_a_request_sent_at_once_is_planned_waits_for_its_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An agent sends its next turn the moment a reply ends; the request before it still holds its
    # slot, being tokenized: the next turn waits for that slot rather than take the other one.
    rig = make_rig(tmp_path, ScriptedProvider())
    turn2 = f"{LONG} and a question on it"
    turn3 = f"{turn2} and then another"
    planning, go = trio.Event(), trio.Event()

    async def held_in_planning(provider: Provider | None, prompt: Prompt, req: str, **kwargs: Any) -> Plan:
        if prompt.text == turn2:
            planning.set()
            await go.wait()
        return await plan_with(provider, prompt, req, **kwargs)

    monkeypatch.setattr("supervisor.routes.completion.plan_with", held_in_planning)
    slots = rig.completions.slots
    with trio.fail_after(TIMEOUT):
        await rig.post("/completion", {"prompt": LONG, "n_predict": 2})
        async with trio.open_nursery() as turns:
            turns.start_soon(rig.post, "/completion", {"prompt": turn2, "n_predict": 2})
            await planning.wait()
            turns.start_soon(rig.post, "/completion", {"prompt": turn3, "n_predict": 2})
            await wait_until(lambda: slots.statistics().keep_waiting == 1)
            go.set()
    assert len({line.slot for line in rig.lines}) == 1
    assert slots.statistics().keep_waits == 1


async def test_a_stream_sent_at_once_and_hung_up_is_keyed_by_its_tokens_and_kept_in_the_prefix_store(
    tmp_path: Path,
) -> None:
    # A user pressed stop on a question sent at once: the slot is known by its tokens (else the
    # request after it would be priced as if the slot held nothing) and the store saves the slot.
    rig = make_rig(tmp_path, ScriptedProvider())
    one, two = asking("a first question"), asking("a second question")
    with trio.fail_after(TIMEOUT):
        async with serving_with_store(rig, tmp_path):
            await rig.post("/v1/chat/completions", {"messages": one, "max_tokens": 2})
            await wait_until(lambda: len(rig.lines) == 1)  # its slot saved for the store, and let go
            saves = rig.fake.actions.count(("save", rig.lines[0].slot or 0))
            rig.fake.modes = Modes(hold=True)  # the reply pauses after its first token: the client leaves then
            body = {"messages": two, "max_tokens": 3, "stream": True}
            await asgi.call(rig.front, "POST", "/v1/chat/completions", body, hang_up_on=b"data: ")
            await wait_until(lambda: len(rig.lines) == 2)
    line = rig.lines[1]
    assert line.outcome == "cancelled"
    sent_at = [n for n, (path, _, body) in enumerate(rig.fake.seen) if body.get("messages") == two]
    assert rig.fake.seen[sent_at[0]][0] == "/v1/chat/completions"  # it went at once
    held = rig.completions.slots.holds(line.slot or 0)
    assert held.tokens is not None
    assert len(held.tokens) == line.prompt_tokens
    assert rig.fake.actions.count(("save", line.slot or 0)) == saves + 1  # saved for the store


async def test_with_the_prefix_store_only_a_slot_holding_every_message_but_the_last_takes_a_chat_at_once(
    tmp_path: Path,
) -> None:
    # A fleet's question on a system prompt goes at once: no stored prefix can hold more of it than
    # the slot.  A conversation whose slot holds only its system prompt (another took the slot) is
    # planned: the store may hold its earlier turns.
    rig = make_rig(tmp_path, ScriptedProvider())
    one, two = asking("a first question"), asking("a second question")
    # Another conversation's turn on the same system prompt, its history short beside it.
    other = [SYSTEM, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    other.append({"role": "user", "content": "and now"})
    with trio.fail_after(TIMEOUT):
        async with serving_with_store(rig, tmp_path):
            for messages in (one, two, other):
                reply = await rig.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
                assert reply.status == 200

    def first(path: str, messages: list[dict[str, str]]) -> int:
        return next(n for n, (p, _, body) in enumerate(rig.fake.seen) if p == path and body["messages"] == messages)

    def went_at_once(messages: list[dict[str, str]]) -> bool:
        return first("/v1/chat/completions", messages) < first("/apply-template", messages)

    assert [went_at_once(messages) for messages in (one, two, other)] == [False, True, False]


async def test_a_prompt_the_decoder_loads_from_its_prompt_cache_is_not_counted_there_for_a_request_beside_it(
    tmp_path: Path,
) -> None:
    # The fleet's ask 58: two questions on a system prompt no slot holds, the second sent while the
    # first still runs.  llama-server loaded the prompt from its cache into the first one's slot,
    # which takes it out of the cache: the second, pinned to the other slot, evaluates all of it.
    rig = make_rig(tmp_path, ScriptedProvider(), prompt_cache_mib=-1)  # llama-server's cache, unbounded
    slots = rig.completions.slots
    slots.remember(0, PromptKey(tokens=tuple(rig.fake.tokenize(LONG))))
    slots.remember(0, PromptKey(tokens=tuple(rig.fake.tokenize("another prompt " * 100))))  # to the cache
    slots.remember(1, PromptKey(tokens=tuple(rig.fake.tokenize("a third prompt " * 100))))
    rig.fake.modes = Modes(hold=["first"])
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rig.post, "/completion", {"prompt": f"{LONG} first", "n_predict": 2})
            await trio.testing.wait_all_tasks_blocked()  # the first one's reply held at the decoder
            await rig.post("/completion", {"prompt": f"{LONG} second", "n_predict": 2})
            rig.fake.release.set()
    second, first = rig.lines
    assert first.slot != second.slot
    assert first.est_plain_ms is not None
    assert second.est_plain_ms is not None
    assert second.est_plain_ms > 10 * first.est_plain_ms, (first, second)
