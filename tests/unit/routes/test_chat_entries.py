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

from tests.fakes.llama import completion as fake_completion
from tests.fakes.llama import endpoints as fake_endpoints
from tests.fakes.llama.core import chatml
from tests.rigs.helpers import wait_until
from tests.rigs.rig import ScriptedProvider
from tests.unit.routes.test_completions import make_rig, restart_decoder, serving_with_store
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
