"""routes/guess.py: a prompt's tokens guessed from its text against what its slot holds, and which
prompts a text describes whole."""

from __future__ import annotations

import json

from supervisor.llama.slots import PromptKey
from supervisor.routes.guess import GENERATION_TOKENS, guess, readable, unstored, within
from supervisor.routes.prompt import Chat, Text, parse

# The fake tokenizer's one token a word (tests/fakes/llama/core.py): a word and its space, 6 characters.
WORDS = " ".join(f"w{i:04d}" for i in range(300))


def tokens(text: str) -> tuple[int, ...]:
    return tuple(hash(word) for word in text.split())


def test_the_guess_keeps_no_more_and_counts_no_fewer_tokens_than_the_prompt_has() -> None:
    held = PromptKey(WORDS, tokens(WORDS))
    # Words of half the slot's length still come out high: the tail is counted twice.
    for tail in ("", " one", " a question of eight words on the prompt", " ab" * 40):
        text = WORDS + tail
        guessed = guess(held, text)
        assert guessed is not None
        assert guessed.cached <= len(held.tokens or ())  # held in full at most
        assert guessed.tokens >= len(tokens(text))  # the tail counted high
        assert guessed.held == (held.tokens or ())[: guessed.cached]
    # The tail's tokens are a word per 6 characters at the slot's rate, counted twice, and the
    # generation prompt's few: a question of 8 words is guessed at 300 + 2 * 7 + 8.
    question = guess(held, WORDS + " a question of eight words on the prompt")
    assert question is not None
    assert question.tokens == 300 + 2 * 7 + GENERATION_TOKENS
    assert question.cached == 285
    assert question.holds_most
    # Priced at the likelier counts until its tokens are known: the tail once, ChatML's opening.
    assert (question.likely_cached, question.likely_tokens) == (300, 300 + 7 + 3)


def test_a_prompt_that_parts_early_holds_little_and_one_sharing_nothing_is_not_guessed() -> None:
    held = PromptKey(WORDS, tokens(WORDS))
    parted = guess(held, WORDS[:60] + " and then something else " * 40)
    assert parted is not None
    assert not parted.holds_most
    assert guess(held, "nothing in common") is None
    assert guess(PromptKey(WORDS), WORDS) is None  # the slot's tokens are not known


def test_a_slot_that_would_keep_under_half_of_what_it_holds_is_not_taken_at_once() -> None:
    # A long chat in the slot, then a short prompt on its first half: the slot holds all of the
    # prompt but keeps under half of itself, so llama-server loads from its prompt cache instead
    # (and takes the entry it loads out of the cache), which only a plan prices.
    long_chat = WORDS + " and the rest of a long conversation" * 60
    held = PromptKey(long_chat, tokens(long_chat))
    short = guess(held, WORDS + " a question")
    assert short is not None
    assert 2 * short.cached >= short.tokens  # the prompt is mostly the slot's
    assert not short.holds_most
    half = guess(PromptKey(WORDS, tokens(WORDS)), WORDS + " a question")
    assert half is not None
    assert half.holds_most


def test_only_a_text_or_a_chat_with_nothing_templated_beside_its_messages_is_readable() -> None:
    messages = [{"role": "user", "content": "hello"}]
    assert readable(parse("/completion", {"prompt": "hello", "n_predict": 4}))
    assert readable(parse("/v1/chat/completions", {"messages": messages, "max_tokens": 4, "stream": True}))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert not readable(parse("/v1/chat/completions", {"messages": messages, "tools": tools}))
    kwargs = {"enable_thinking": False}
    assert not readable(parse("/v1/chat/completions", {"messages": messages, "chat_template_kwargs": kwargs}))
    assert not readable(parse("/completion", {"prompt": [1, 2, 3]}))  # tokens: nothing to spare


def test_a_tail_outside_ascii_counts_a_token_a_character_at_least() -> None:
    # A question in Japanese after an English system prompt: 5 characters a token there, one here.
    held = PromptKey(WORDS, tokens(WORDS))
    question = guess(held, WORDS + " 日本語で答えてください")
    assert question is not None
    assert question.likely_tokens >= 300 + 11


def test_a_chats_last_message_starts_where_its_json_says() -> None:
    messages = [
        {"role": "system", "content": 'a "quoted" system prompt\nover two lines'},
        {"role": "user", "content": "日本語の質問"},
    ]
    chat = parse("/v1/chat/completions", {"messages": messages})
    assert isinstance(chat, Chat)
    assert chat.text[chat.last :] == json.dumps(messages[-1], separators=(",", ":"), ensure_ascii=False) + "]"


def test_with_the_prefix_store_only_a_chat_matched_to_its_last_message_is_unstored() -> None:
    system = {"role": "system", "content": WORDS}
    asked = parse("/v1/chat/completions", {"messages": [system, {"role": "user", "content": "a second question"}]})
    held_chat = parse("/v1/chat/completions", {"messages": [system, {"role": "user", "content": "a first one"}]})
    assert isinstance(asked, Chat)
    assert isinstance(held_chat, Chat)
    held = PromptKey(held_chat.text, tokens(held_chat.text))
    on_its_system_prompt = guess(held, asked.text)
    assert on_its_system_prompt is not None
    assert unstored(asked, on_its_system_prompt)
    # Its slot holds another conversation: parted before the last message (an earlier turn).
    later = parse(
        "/v1/chat/completions",
        {
            "messages": [
                system,
                {"role": "user", "content": "a third"},
                {"role": "assistant", "content": "x"},
                {"role": "user", "content": "y"},
            ]
        },
    )
    assert isinstance(later, Chat)
    other = guess(held, later.text)
    assert other is not None
    assert not unstored(later, other)
    # A text: never (a later turn of it may be stored from another slot or host).
    text = parse("/completion", {"prompt": WORDS + " more"})
    assert isinstance(text, Text)
    texts = guess(PromptKey(WORDS, tokens(WORDS)), text.text)
    assert texts is not None
    assert not unstored(text, texts)


def test_a_prompt_fits_a_slots_context_with_its_tail_counted_at_a_token_a_byte() -> None:
    held = PromptKey(WORDS, tokens(WORDS))
    asked = WORDS + " 日本"  # 7 bytes of tail
    guessed = guess(held, asked)
    assert guessed is not None
    assert within(guessed, asked, None)
    assert within(guessed, asked, 300 + 7 + GENERATION_TOKENS + 1)
    assert not within(guessed, asked, 300 + 7 + GENERATION_TOKENS)
