"""A chat's prefix-store entry on a model whose state can be cut back (supervisor/routes/stored.py's
``after`` with routes/boundary.py's ``entry_end``), against tests/fakes/llama/inprocess.py: it ends
before the template's generation prompt, where the conversation's next turn still matches it token for
token, so the next turn restores it even where it tokenizes the generation prompt's last token merged
with the reply after it (as the tiny llama model does with the "\\n" it ends with)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from supervisor.llama.slots import PromptKey, SlotPool
from supervisor.llama.statefile import MAGIC_BYTES as STATE_MAGIC
from supervisor.routes import boundary
from supervisor.routes.capability import Capability, Restores
from supervisor.routes.plan import Plan
from supervisor.routes.prompt import Chat
from supervisor.routes.stored import Marked, StoredPrefixes
from tests.fakes.llama import completion as fake_completion
from tests.fakes.llama import endpoints as fake_endpoints
from tests.fakes.llama.core import chatml
from tests.rigs.helpers import wait_until
from tests.rigs.rig import ScriptedProvider
from tests.unit.prefix.test_prefix_store import private_store
from tests.unit.routes.test_completions import FINGERPRINT, make_rig, restart_decoder, serving_with_store
from tests.unit.routes.test_hybrid_store import chat, stores

TIMEOUT = 10
CHAT = "/v1/chat/completions"


def merging(messages: Any, *, generation_prompt: bool = True) -> str:
    """ChatML whose assistant turn opens glued to its content: with the fake's one-word tokens, the
    generation prompt's last token and the reply's first word are one token once the reply follows."""
    text = chatml(messages, generation_prompt=generation_prompt)
    return text.replace("<|im_start|>assistant\n", "<|im_start|>assistant")


@pytest.mark.parametrize("merge", [False, True], ids=["apart", "merged"])
async def test_a_chats_second_turn_after_a_restart_restores_its_first_up_to_its_generation_prompt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, merge: bool
) -> None:
    if merge:
        monkeypatch.setattr(fake_endpoints, "chatml", merging)
        monkeypatch.setattr(fake_completion, "chatml", merging)
    rig = make_rig(tmp_path, ScriptedProvider(ready=False))
    turns = ["how heavy is box 7 in the store room"]
    with trio.fail_after(TIMEOUT):
        async with serving_with_store(rig, tmp_path) as store:
            reply = await rig.post(CHAT, chat(*turns))
            await wait_until(partial(stores, store, 1))
            restart_decoder(rig)
            turns += [reply.json()["choices"][0]["message"]["content"], "and box 8 next to it"]
            await rig.post(CHAT, chat(*turns))
            [entry] = store.list()
    cold, warm = rig.lines
    assert cold.prompt_tokens is not None
    # The entry ends before the generation prompt (one token here): the next turn starts with it.
    assert entry.n_tokens == cold.prompt_tokens - 1
    assert (warm.fallback, warm.restored_tokens) == ("no-provider>stored", entry.n_tokens)


class Counting:
    """A decoder client that only counts what it is asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def post_json(self, path: str, body: Any) -> tuple[int, Any]:
        self.asked.append(path)
        if path == "/apply-template":
            return 200, {"prompt": "a b"}
        return 200, {"tokens": [1, 2]}


@pytest.mark.parametrize(("n_tokens", "asked"), [(3, 0), (4, 2)], ids=["shorter-than-the-store-keeps", "kept"])
async def test_a_chat_too_short_for_the_store_costs_no_render_after_its_reply(
    tmp_path: Path, n_tokens: int, asked: int
) -> None:
    """The entry's end is rendered (``/apply-template`` and ``/tokenize``) only for a prompt the store
    may keep (``min_tokens``, 4 here): a short chat's reply is not held up by two decoder calls."""
    store = await private_store(tmp_path / "store", fingerprint=FINGERPRINT, max_bytes=1 << 20, min_tokens=4)
    client = Counting()
    try:
        stored = StoredPrefixes(client=client, state_dir=tmp_path, store=store, capability=None)
        chat_prompt = Chat(body={"messages": [{"role": "user", "content": "hi"}]}, text="hi")
        planned = Plan(PromptKey("hi", tuple(range(1, n_tokens + 1))), None, prompt=chat_prompt)
        with trio.fail_after(TIMEOUT):
            ends = await boundary.entry_end(client, planned, stored)
    finally:
        store.close()
    assert len(client.asked) == asked
    assert ends == (2 if asked else None)


async def test_a_drain_that_comes_right_after_a_reply_waits_for_its_entry(tmp_path: Path) -> None:
    """A write handed to the store counts as in progress from the moment it is handed over: a drain's
    ``wait_writes`` that runs before the write's task has started still waits for it (it found nothing
    in progress, returned, and the drain saved the slot whole as a second entry: test_real_store
    counted 4 entries for 3 in CI)."""
    store = await private_store(tmp_path / "store", fingerprint=FINGERPRINT, max_bytes=1 << 20, min_tokens=4)
    try:
        stored = StoredPrefixes(client=Counting(), state_dir=tmp_path, store=store, capability=None)
        path = tmp_path / "marked.keep"
        path.write_bytes(STATE_MAGIC + b"\0" * 1024)
        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                await nursery.start(stored.run)
                stored.keep_marked(Marked((1, 2, 3, 4, 5), path, None))
                await stored.wait_writes()  # no checkpoint between: the write's task has not run yet
                assert [entry.n_tokens for entry in store.list()] == [5]
                nursery.cancel_scope.cancel()
    finally:
        store.close()


class Refusing:
    """A decoder client that must not be asked anything."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def post_json(self, path: str, body: Any) -> tuple[int, Any]:
        self.asked.append(path)
        return 500, {"error": {"message": "not expected"}}


async def test_a_branch_point_is_kept_at_a_whole_block_so_every_question_meets_the_same_entry(tmp_path: Path) -> None:
    """Two questions on one system prompt part where their first words stop matching: the entry ends
    at the multiple of BRANCH_TOKENS below that, the same for every question."""
    store = await private_store(tmp_path / "store", fingerprint=FINGERPRINT, max_bytes=1 << 20, min_tokens=64)
    try:
        stored = StoredPrefixes(client=Refusing(), state_dir=tmp_path, store=store, capability=None)
        tokens = tuple(range(1, 300))
        assert stored.candidate(tokens, 203, extends=False) == tokens[:192]
        assert stored.candidate(tokens, 205, extends=False) == tokens[:192]
        assert stored.candidate(tokens, 203, extends=True) == tokens  # a conversation's next turn: whole
    finally:
        store.close()


async def test_a_prefix_the_decoders_prompt_cache_would_load_is_not_restored_from_the_disk(tmp_path: Path) -> None:
    """The fleet benchmark: 6 system prompts over 4 slots.  A question on a system prompt that no slot
    holds, but llama-server's prompt cache does, is served from memory: a restore from the store
    would read a file for what the cache loads in a copy (it cost 50 ms a request there, median)."""
    store = await private_store(tmp_path / "store", fingerprint=FINGERPRINT, max_bytes=1 << 26, min_tokens=64)
    client = Refusing()
    system = tuple(range(1, 701))
    try:
        state = tmp_path / "saved.keep"
        state.write_bytes(STATE_MAGIC + b"\0" * 1024)
        assert await store.put_file(system, state)
        stored = StoredPrefixes(client=client, state_dir=tmp_path, store=store, capability=None)
        slots = SlotPool(2, queue_limit=8)
        slots.remember(0, PromptKey(tokens=(*system, 1)))
        slots.remember(0, PromptKey(tokens=tuple(range(5000, 5700))))  # the first moves to the cache
        asked = PromptKey(tokens=(*system, 2, 3))
        with trio.fail_after(TIMEOUT):
            restored = await stored.before(
                0, asked, slots, decoder_ms_per_token=5.0, restore_ms=lambda _: 1.0, req="r", prompt_cache=10_000
            )
    finally:
        store.close()
    assert (restored.entry, client.asked) == (None, [])


async def test_where_a_state_cannot_be_cut_back_the_store_restores_what_the_prompt_cache_holds_past_it(
    tmp_path: Path,
) -> None:
    """A hybrid model's cached prompt goes on past where the next one parts (its reply, another
    question): llama-server cannot cut its recurrent state back to there, so the store's entry at the
    boundary is restored whatever the prompt cache holds."""
    store = await private_store(tmp_path / "store", fingerprint=FINGERPRINT, max_bytes=1 << 26, min_tokens=64)
    client = Refusing()
    system = tuple(range(1, 701))
    capability = Capability("hybrid")
    capability.restores = Restores.PREFIX
    try:
        state = tmp_path / "saved.keep"
        state.write_bytes(STATE_MAGIC + b"\0" * 1024)
        assert await store.put_file(system, state)
        stored = StoredPrefixes(client=client, state_dir=tmp_path, store=store, capability=capability)
        slots = SlotPool(2, queue_limit=8)
        slots.remember(0, PromptKey(tokens=(*system, 1)))
        slots.remember(0, PromptKey(tokens=tuple(range(5000, 5700))))
        asked = PromptKey(tokens=(*system, 2, 3))
        with trio.fail_after(TIMEOUT):
            await stored.before(
                0, asked, slots, decoder_ms_per_token=5.0, restore_ms=lambda _: 1.0, req="r", prompt_cache=10_000
            )
    finally:
        store.close()
    assert client.asked  # the restore was asked for (this client refuses it)


async def test_a_question_on_a_stored_system_prompt_asks_the_decoder_nothing_after_its_reply(tmp_path: Path) -> None:
    """The fleet benchmark: most requests are a new question on one of a few system prompts the store
    holds already.  Wherever such a chat's entry ended, what would be kept is that system prompt
    (rounded to BRANCH_TOKENS), which is stored: once a chat's generation prompt has been measured,
    its end is not asked for (``/apply-template`` and ``/tokenize`` while the slot is held).  Before
    that, and for a conversation's next turn (kept whole up to its end), it is."""
    store = await private_store(tmp_path / "store", fingerprint=FINGERPRINT, max_bytes=1 << 26, min_tokens=64)
    system = tuple(range(1, 701))
    chat_prompt = Chat(body={"messages": [{"role": "user", "content": "hi"}]}, text="hi")
    try:
        state = tmp_path / "saved.keep"
        state.write_bytes(STATE_MAGIC + b"\0" * 1024)
        assert await store.put_file(system[:640], state)  # the system prompt, as a branch point keeps it
        client = Refusing()
        stored = StoredPrefixes(client=client, state_dir=tmp_path, store=store, capability=None)
        slots = SlotPool(2, queue_limit=8)
        slots.remember(0, PromptKey(tokens=(*system, *range(9000, 9030))))  # another question on it
        question = Plan(PromptKey("q", (*system, *range(2000, 2020))), None, prompt=chat_prompt)
        turn = Plan(PromptKey("t", (*system, *range(9000, 9030), *range(3000, 3020))), None, prompt=chat_prompt)
        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                await nursery.start(stored.run)
                unmeasured = stored.may_keep(question.key, slots, restored=None)
                stored.learn_slack(n_tokens=720, ends=717)  # a chat's generation prompt: 3 tokens
                await boundary.keep_after(client, question, stored, 1, slots, req="r", restored=None)
                asked_after_question = list(client.asked)
                next_turn = stored.may_keep(turn.key, slots, restored=None)
                nursery.cancel_scope.cancel()
    finally:
        store.close()
    assert unmeasured  # the slack not yet measured: the end is asked for
    assert asked_after_question == []
    assert next_turn  # a conversation's next turn is kept whole up to its end: asked for


class Waiting:
    """A decoder client that renders and tokenizes a chat as ``tokens`` once ``go`` is set."""

    def __init__(self, tokens: tuple[int, ...]) -> None:
        self.tokens = tokens
        self.asked = trio.Event()
        self.go = trio.Event()

    async def post_json(self, path: str, body: Any) -> tuple[int, Any]:
        self.asked.set()
        await self.go.wait()
        if path == "/apply-template":
            return 200, {"prompt": "rendered"}
        return 200, {"tokens": list(self.tokens[:-3])}


async def test_a_chats_slot_waits_for_its_next_turn_from_the_start_of_the_work_after_its_reply(tmp_path: Path) -> None:
    """The front takes a client's next request while the last one's work after its reply goes on
    (supervisor/http/asgi.py's ``serve``): a next turn that comes while the chat's end is still asked
    (two calls to the decoder, before the save) waits for the slot that holds its prefix, not a cold one."""
    store = await private_store(tmp_path / "store", fingerprint=FINGERPRINT, max_bytes=1 << 20, min_tokens=4)
    tokens = tuple(range(1, 101))
    chat_prompt = Chat(body={"messages": [{"role": "user", "content": "hi"}]}, text="hi")
    planned = Plan(PromptKey("hi", tokens), None, prompt=chat_prompt)
    client = Waiting(tokens)
    slots = SlotPool(2, queue_limit=8)
    seen: list[str] = []

    async def asked_meanwhile(slot: int) -> None:
        await client.asked.wait()
        seen.append(slots.statistics().each[slot].state)
        client.go.set()

    try:
        stored = StoredPrefixes(client=client, state_dir=tmp_path, store=store, capability=None)
        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                await nursery.start(stored.run)
                async with slots.hold(planned.key) as slot:
                    nursery.start_soon(asked_meanwhile, slot)
                    await boundary.keep_after(client, planned, stored, slot, slots, req="r", restored=None)
                nursery.cancel_scope.cancel()
    finally:
        store.close()
    assert seen == ["kept"]


class Rendering:
    """A decoder client whose template renders a chat alike with and without the generation prompt
    (a continued assistant message): its tokens are ``tokens`` either way."""

    def __init__(self, tokens: tuple[int, ...]) -> None:
        self.tokens = tokens

    async def post_json(self, path: str, body: Any) -> tuple[int, Any]:
        if path == "/apply-template":
            return 200, {"prompt": "the same"}
        return 200, {"tokens": list(self.tokens)}


@pytest.mark.parametrize(
    ("rendered", "learnt"), [((1, 2, 3), 97), (tuple(range(1, 101)), None)], ids=["parts", "alike"]
)
async def test_only_a_chat_whose_messages_part_before_its_end_measures_the_generation_prompt(
    tmp_path: Path, rendered: tuple[int, ...], learnt: int | None
) -> None:
    """A chat rendered alike with and without a generation prompt (its last message the assistant's,
    continued) ends a token short by rule, which says nothing of the template's generation prompt: a
    slack learnt from it (1) let a conversation's next turn under a longer one go unkept."""
    store = await private_store(tmp_path / "store", fingerprint=FINGERPRINT, max_bytes=1 << 20, min_tokens=4)
    tokens = tuple(range(1, 101))
    try:
        stored = StoredPrefixes(client=Rendering(rendered), state_dir=tmp_path, store=store, capability=None)
        chat_prompt = Chat(body={"messages": [{"role": "user", "content": "hi"}]}, text="hi")
        planned = Plan(PromptKey("hi", tokens), None, prompt=chat_prompt)
        with trio.fail_after(TIMEOUT):
            await boundary.entry_end(Rendering(rendered), planned, stored)
    finally:
        store.close()
    assert stored.chat_slack == learnt
