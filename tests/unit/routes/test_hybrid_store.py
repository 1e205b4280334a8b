"""A hybrid model's prompts kept (supervisor/routes/stored.py, supervisor/routes/prompt.py's
``boundary``), against tests/fakes/llama/inprocess.py in its recurrent mode (a slot holds the reply too, and
nothing is cut back): what is handed over or kept ends where the conversation's next turn still
matches it, a chat's before the generation prompt, a text's less its last token; a conversation's
next turn after a restart restores from the prefix store and the decoder evaluates only what is new;
a request cancelled after the boundary save leaves no file and no entry; an entry that restores
short, or of another memory layout, is never used.  The same on the real llama-server, per family:
tests/real/test_real_families.py."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from supervisor.prefix.store import PrefixStore
from supervisor.routes import boundary, prompt
from supervisor.routes.capability import Capability, Restores
from tests.fakes.llama import endpoints as fake_endpoints
from tests.fakes.llama.core import Modes, chatml
from tests.fakes.llama.inprocess import FakeLlama
from tests.rigs import asgi
from tests.rigs.helpers import wait_until
from tests.rigs.rig import ScriptedProvider
from tests.unit.routes.test_completions import FINGERPRINT, SETTINGS, Rig, make_rig, restart_decoder, serving_with_store

TIMEOUT = 10
SYSTEM = "you are a careful assistant who answers every question about the weights of boxes in full"
CHAT = "/v1/chat/completions"


def hybrid_rig(tmp_path: Path, provider: ScriptedProvider | None = None) -> Rig:
    """A rig whose decoder's state cannot be cut back, its probe's verdict ``prefix``."""
    rig = make_rig(tmp_path, provider or ScriptedProvider(ready=False))
    rig.fake.modes = Modes(recurrent=True)
    found = Capability("fake-model")
    found.set(Restores.PREFIX, "recurrent")
    rig.completions.capability = found
    assert rig.completions.hybrid is not None
    rig.completions.hybrid.file.capability = found
    return rig


def messages(*turns: str) -> list[dict[str, str]]:
    """A conversation: the system prompt, then the user's and the assistant's turns alternating."""
    said = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(turns):
        said.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return said


def chat(*turns: str) -> dict[str, Any]:
    return {"messages": messages(*turns), "max_tokens": 3}


def tokens_of(*turns: str, generation_prompt: bool = True) -> list[int]:
    """The fake decoder's tokens for the conversation (tests/fakes/llama/core.py's ChatML)."""
    return FakeLlama.tokenize(chatml(messages(*turns), generation_prompt=generation_prompt))


def stores(store: PrefixStore, n: int) -> bool:
    return store.statistics().stores == n


def count(value: int | None) -> int:
    assert value is not None
    return value


def keep_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.keep"))


# -- the boundary -------------------------------------------------------------------------------------


async def test_a_chats_boundary_is_before_its_generation_prompt_and_a_texts_its_last_token(tmp_path: Path) -> None:
    client = FakeLlama(tmp_path).client()
    whole = tuple(tokens_of("how heavy is box 7"))
    before = tokens_of("how heavy is box 7", generation_prompt=False)
    with trio.fail_after(TIMEOUT):
        found = await boundary.find(client, prompt.Chat(chat("how heavy is box 7"), ""), whole)
        text = await boundary.find(client, prompt.Text("a b c", "a b c"), (1, 2, 3))
        # A template that renders the messages otherwise without its generation prompt: no point
        # the next turn keeps, so nothing is kept.
        other = await boundary.find(client, prompt.Chat(chat("how heavy is box 7"), ""), (9, *whole))
        # The messages' last token merged with the generation prompt's first (a vocabulary without
        # the template's markers): the next turn parts from this one a token earlier too.
        merged = await boundary.find(client, prompt.Chat(chat("how heavy is box 7"), ""), (*before[:-1], 7, 8))
    assert merged == len(before) - 1
    assert found == len(before) == len(whole) - 1
    assert text == 2
    assert other is None


# -- a conversation kept ------------------------------------------------------------------------------


async def three_turns(rig: Rig, tmp_path: Path, *, restart_before_third: bool = True) -> list[Any]:
    """Three turns of one conversation, the decoder restarted (its slots empty) before the third."""
    replies: list[str] = []
    turns: list[str] = ["how heavy is box 7 in the store room"]
    async with serving_with_store(rig, tmp_path) as store:
        for n in range(3):
            if n == 2 and restart_before_third:
                restart_decoder(rig)
            reply = await rig.post(CHAT, chat(*turns))
            assert reply.status == 200, reply.body
            replies.append(reply.json()["choices"][0]["message"]["content"])
            await wait_until(partial(stores, store, n + 1))
            turns += [replies[-1], f"and box {n + 8} next to it"]
        entries = store.list()
    return entries


async def test_a_hybrid_conversations_third_turn_after_a_restart_restores_its_boundary_and_evaluates_the_new_turn(
    tmp_path: Path,
) -> None:
    rig = hybrid_rig(tmp_path)
    with trio.fail_after(TIMEOUT):
        entries = await three_turns(rig, tmp_path)
    *_, third = rig.lines
    lengths = [count(line.prompt_tokens) for line in rig.lines]
    # Each turn's entry ends before its generation prompt (one token here): the next turn starts with it.
    assert sorted(e.n_tokens for e in entries) == [n - 1 for n in lengths]
    assert (third.fallback, third.restored_tokens) == ("no-provider>stored", lengths[1] - 1)
    # The third turn's new tokens (the reply, the new message) and the generation prompt, nothing
    # more, the prefill up to its boundary counted in.
    new = lengths[2] - lengths[1]
    assert count(third.decoder_prompt_n) <= new + 1 + 2, third
    # The decoder prefilled each turn to its boundary and saved it before the rest, and its last
    # request evaluated the generation prompt alone.
    saves = [action for action, _ in rig.fake.actions if action == "save"]
    assert len(saves) == 3
    assert rig.fake.requests[-1].prompt_n == 1
    assert keep_files(tmp_path) == []


async def test_a_hybrid_models_slot_is_never_saved_after_its_reply(tmp_path: Path) -> None:
    rig = hybrid_rig(tmp_path)
    with trio.fail_after(TIMEOUT):
        entries = await three_turns(rig, tmp_path, restart_before_third=False)
    # Every entry ends at its boundary: none holds a reply's tokens after the prompt.
    prompts = [r.prompt for r in rig.fake.requests if r.path == CHAT]
    assert sorted(e.tokens for e in entries) == sorted(tuple(p[:-1]) for p in prompts)


async def continued(rig: Rig, tmp_path: Path, *, torn: bool = False) -> int:
    """A raw prompt, then its continuation after a restart (``torn``: the state restores a token
    short); the store's drops."""
    first = "item 1 weighs 7 units and item 2 weighs 1 unit"
    with trio.fail_after(TIMEOUT):
        async with serving_with_store(rig, tmp_path) as store:
            await rig.post("/completion", {"prompt": first, "n_predict": 3})
            await wait_until(lambda: store.statistics().stores == 1)
            restart_decoder(rig)
            rig.fake.modes = Modes(recurrent=True, restore_wrong_n=torn)
            await rig.post("/completion", {"prompt": f"{first} and item 3", "n_predict": 3})
            await wait_until(lambda: store.statistics().stores >= 1)
            return store.statistics().drops


async def test_a_raw_completion_is_kept_less_its_last_token_and_its_continuation_restores_it(tmp_path: Path) -> None:
    rig = hybrid_rig(tmp_path)
    await continued(rig, tmp_path)
    cold, warm = rig.lines
    assert warm.restored_tokens == count(cold.prompt_tokens) - 1
    # The prefill up to the new boundary, then its last token.
    assert warm.decoder_prompt_n == count(warm.prompt_tokens) - count(warm.restored_tokens)


async def test_a_hybrid_chat_handed_over_ends_at_its_boundary_and_is_kept_from_there(tmp_path: Path) -> None:
    provider = ScriptedProvider()
    rig = hybrid_rig(tmp_path, provider)
    with trio.fail_after(TIMEOUT):
        async with serving_with_store(rig, tmp_path) as store:
            reply = await rig.post(CHAT, chat("how heavy is box 7 in the store room"))
            await wait_until(lambda: store.statistics().stores == 1)
            [entry] = store.list()
    assert reply.status == 200
    [line] = rig.lines
    [job] = provider.jobs
    assert len(job.tokens) == count(line.prompt_tokens) - 1 == entry.n_tokens
    assert (line.route, line.fallback, line.decoder_prompt_n) == ("file", None, 1)
    # The slot held the boundary as handed over: saved as it was, no prefill before it.
    assert [r.prompt_n for r in rig.fake.requests] == [1]


async def test_a_hybrid_chat_whose_template_renders_otherwise_keeps_nothing_and_says_no_boundary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def dated(messages: Any, *, generation_prompt: bool = True) -> str:
        # A template that renders a date before the messages only without the generation prompt.
        return ("" if generation_prompt else "today ") + chatml(messages, generation_prompt=generation_prompt)

    monkeypatch.setattr(fake_endpoints, "chatml", dated)  # /apply-template's only
    rig = hybrid_rig(tmp_path)
    with trio.fail_after(TIMEOUT):
        async with serving_with_store(rig, tmp_path) as store:
            reply = await rig.post(CHAT, chat("how heavy is box 7 in the store room"))
            stats = store.statistics()
    assert reply.status == 200
    [line] = rig.lines
    assert line.fallback == "no-provider>no-boundary"
    assert (stats.stores, stats.entries) == (0, 0)
    assert "save" not in [action for action, _ in rig.fake.actions]


# -- faults -------------------------------------------------------------------------------------------


async def test_a_request_cancelled_after_its_boundary_save_leaves_no_file_no_entry_and_no_slot(
    tmp_path: Path,
) -> None:
    rig = hybrid_rig(tmp_path)
    rig.fake.modes = Modes(recurrent=True, hold=True)  # the reply pauses after its first token
    body = {**chat("how heavy is box 7 in the store room"), "stream": True}
    with trio.fail_after(TIMEOUT):
        async with serving_with_store(rig, tmp_path) as store:
            await asgi.call(rig.front, "POST", CHAT, body, hang_up_on=b'"content"')
            assert ("save", 0) in rig.fake.actions or ("save", 1) in rig.fake.actions
            stats = store.statistics()
            held = rig.completions.slots.statistics()
    [line] = rig.lines
    assert line.outcome == "cancelled"
    assert keep_files(tmp_path) == []
    assert (stats.stores, stats.entries) == (0, 0)
    assert held.busy == 0


async def test_a_stored_entry_that_restores_short_is_dropped_and_the_request_prefills(tmp_path: Path) -> None:
    rig = hybrid_rig(tmp_path)
    drops = await continued(rig, tmp_path, torn=True)  # a torn state: it restores one token short
    _, warm = rig.lines
    assert warm.restored_tokens is None
    assert warm.decoder_prompt_n is not None
    assert drops == 1


async def test_a_stored_state_holding_more_than_its_entry_is_never_restored_where_it_cannot_be_cut_back(
    tmp_path: Path,
) -> None:
    rig = hybrid_rig(tmp_path)
    prompt_tokens = FakeLlama.tokenize("item 1 weighs 7 units and item 2 weighs 1 unit and item 3")
    with trio.fail_after(TIMEOUT):
        async with serving_with_store(rig, tmp_path) as store:
            # An entry whose state holds three tokens past it (a slot saved after a reply).
            state = tmp_path / "made.keep"
            rig.fake.slots[0] = [*prompt_tokens[:8], 1, 2, 3]
            from supervisor.llama import decoder

            assert isinstance(await decoder.save(rig.fake.client(), 0, state.name), decoder.Saved)
            assert await store.put_file(prompt_tokens[:8], state)
            restart_decoder(rig)
            stored = rig.completions.stored
            assert stored is not None
            [entry] = store.list()
            restored = await stored.restore(0, entry)
    assert restored.entry is None
    assert restored.why.startswith("restored 11 of 8 tokens")
    assert rig.fake.slots[0] == []  # erased after the refused restore


@pytest.mark.parametrize(
    "changed", [{"swa_full": True}, {"kv_unified": True}, {"extra_args": ("--swa-full",)}], ids=str
)
async def test_a_hybrid_entry_is_refused_by_its_fingerprint_under_another_memory_layout(
    tmp_path: Path, changed: dict[str, Any]
) -> None:
    rig = hybrid_rig(tmp_path)
    with trio.fail_after(TIMEOUT):
        async with serving_with_store(rig, tmp_path) as store:
            await rig.post(CHAT, chat("how heavy is box 7 in the store room"))
            await wait_until(lambda: store.statistics().stores == 1)
        restart_decoder(rig)
        async with serving_with_store(rig, tmp_path, attrs.evolve(FINGERPRINT, **changed)) as store:
            assert store.list() == []
            await rig.post(CHAT, chat("how heavy is box 7 in the store room"))
    assert rig.lines[-1].restored_tokens is None
    assert SETTINGS.enabled


@pytest.mark.parametrize("stream", [False, True])
async def test_a_hybrid_chats_own_prefill_to_its_boundary_is_no_cache_hit_in_its_usage(
    tmp_path: Path, stream: bool
) -> None:
    """The plain route's two calls (up to the boundary, then the rest): the second's reply counts the
    first's tokens as cached; the client is told they were evaluated (routes/usage.py)."""
    rig = hybrid_rig(tmp_path)
    with trio.fail_after(TIMEOUT):
        async with serving_with_store(rig, tmp_path):
            body = {**chat("how heavy is box 7 in the store room"), "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            reply = await rig.post(CHAT, body)
            assert reply.status == 200, reply.body
    (line,) = rig.lines
    n_prompt = count(line.prompt_tokens)
    first, rest = rig.fake.requests[-2:]
    assert (first.prompt_n, rest.cache_n) == (n_prompt - 1, n_prompt - 1)  # the decoder's own view
    if stream:
        events = [e for e in reply.body.split(b"\n\n") if e.startswith(b"data: {") and b'"timings"' in e]
        final = json.loads(events[-1].removeprefix(b"data: "))
    else:
        final = reply.json()
    assert final["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert (final["timings"]["prompt_n"], final["timings"]["cache_n"]) == (n_prompt, 0)
    assert count(line.decoder_prompt_n) == n_prompt
