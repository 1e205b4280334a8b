"""A prompt's length, and what its slot holds of it, guessed from its text before it is tokenized:
where the route chosen on that guess is plain, the request goes to the decoder at once and is
planned after its reply (routes/completion.py).

Planning a chat is two calls to the decoder before it is sent, ``/apply-template`` then
``/tokenize``: llama-server's HTTP thread templating and tokenizing the whole prompt, about 5 ms of
each request's first token on the fleet benchmark (docs/benchmarks.md), which a client of
llama-server direct does not pay.  A chat's next turn, or an agent's next question on a system
prompt, matches the text its slot last held (routes/prompt.py: the messages as JSON) to near its
end.  That slot's prompt says how many tokens a character of such text made, so the tokens the slot
keeps and the prompt's length can be guessed from characters: the matched part at that rate less a
twentieth, the tail at twice that rate, and a few tokens more for the generation prompt.  The guess
leans toward plain's cost: it counts no fewer tokens than the prompt has for a tail of up to twice
the slot's tokens per character (tests/unit/routes/test_guess.py), and a plain route it chose that
the tokens would not have is logged (routes/completion.py's ``_priced``).

Only a prompt its text describes whole is guessed: a text, or a chat whose body carries nothing the
template reads beside its messages (tools, template kwargs are not in the text, so a match of the
text says nothing of them); and only where the slot holds half the prompt or more, so plain, if the
guess was wrong, evaluates at most that half.  With the prefix store on, only where no prefix it
keeps can hold more of the prompt than the slot (:func:`unstored`): the store is not looked up for
a request sent at once.
"""

from __future__ import annotations

import math

import attrs

from ..llama.slots import PromptKey, common_prefix
from .prompt import Chat, Prompt, Text

__all__ = ["Guess", "guess", "readable", "unstored", "within"]

# What a chat's body may carry beside its messages for its text to be the template's whole input:
# sampling, streaming, and the fields onebitd or the client's library add; anything else (tools,
# tool_choice, chat_template_kwargs, response_format, reasoning fields...) may change the rendering.
NOT_TEMPLATED = frozenset(
    {
        "messages",
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "n_predict",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "typical_p",
        "seed",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "repeat_penalty",
        "repeat_last_n",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "n",
        "user",
        "cache_prompt",
        "id_slot",
        "timings_per_token",
        # llama-server's own sampling and output fields (tools/server/README.md's /completion options)
        "ignore_eos",
        "n_probs",
        "min_keep",
        "n_keep",
        "n_discard",
        "t_max_predict_ms",
        "mirostat",
        "mirostat_tau",
        "mirostat_eta",
        "dynatemp_range",
        "dynatemp_exponent",
        "xtc_probability",
        "xtc_threshold",
        "top_n_sigma",
        "dry_multiplier",
        "dry_base",
        "dry_allowed_length",
        "dry_penalty_last_n",
        "dry_sequence_breakers",
        "samplers",
        "post_sampling_probs",
        "return_tokens",
        "response_fields",
    }
)

# The matched part's tokens are guessed this much low, the tail's this many times high, and the
# template's generation prompt (an assistant turn's opening) adds this many tokens at most.
CACHED_SHARE = 0.95
TAIL_FACTOR = 2
GENERATION_TOKENS = 8
LIKELY_GENERATION_TOKENS = 3  # ChatML's "<|im_start|>assistant\n"


@attrs.frozen
class Guess:
    """A prompt's tokens as guessed from its text: ``cached``, those the slot holds (``held``, the
    slot's own first tokens: what a provider's cache is asked about); ``tokens``, its length."""

    cached: int
    tokens: int
    held: tuple[int, ...]
    matched: int  # the characters of the prompt's text the slot's text holds
    # The likelier counts: the matched part whole, the tail once, the generation prompt's usual
    # few.  What the request is priced at until its tokens are known (the prefill it puts in flight).
    likely_cached: int = 0
    likely_tokens: int = 0
    whole: int = 0  # the tokens the slot holds

    @property
    def holds_most(self) -> bool:
        """Half the prompt or more is the slot's, and the slot keeps half or more of what it holds:
        below that llama-server loads the best match from its prompt cache instead, which only a
        plan prices (llama/slots.py's ``reusable``)."""
        return 2 * self.cached >= self.tokens and 2 * self.cached >= self.whole


def readable(prompt: Prompt) -> bool:
    """Whether the prompt's text is all the decoder renders of it (a text, or a plain chat)."""
    if isinstance(prompt, Text):
        return True
    return isinstance(prompt, Chat) and prompt.body.keys() <= NOT_TEMPLATED


def guess(held: PromptKey, text: str) -> Guess | None:
    """The prompt of ``text`` guessed against ``held``, what its slot holds; None where the slot's
    tokens are not known, or its text shares nothing with this one."""
    if not held.tokens or not held.text:
        return None
    matched = common_prefix(held.text, text)
    if matched == 0:
        return None
    per_char = len(held.tokens) / len(held.text)
    shared = min(len(held.tokens), math.floor(matched * per_char))
    cached = math.floor(CACHED_SHARE * shared)
    rest = text[matched:]
    # A character outside ASCII (CJK, an emoji) is a token or more whatever the slot's rate was.
    outside_ascii = len(rest) - len(rest.encode("ascii", "ignore"))  # counted in C: a tail may be long
    tail = max(math.ceil(len(rest) * per_char), outside_ascii)
    tokens = shared + TAIL_FACTOR * tail + GENERATION_TOKENS
    likely = shared + tail + LIKELY_GENERATION_TOKENS
    return Guess(
        cached,
        tokens,
        held.tokens[:cached],
        matched,
        likely_cached=shared,
        likely_tokens=likely,
        whole=len(held.tokens),
    )


def unstored(prompt: Chat | Text, guessed: Guess) -> bool:
    """Whether no prefix the prefix store keeps can hold much more of the prompt than the slot it
    was guessed against.  A chat's entry ends where an earlier request's messages ended, or where
    two prompts part (rounded down, routes/stored.py's ``candidate``): a slot whose text matches all
    of the chat's messages before the last holds as much as the first, and at most the last
    message's opening less than the second (an agent fleet's question on a system prompt; a
    conversation's next turn parts from its slot's text before the reply, so it is planned).  A
    text's entry may be a later turn of it, served on another slot or another host of a shared
    store: a text is never taken at once with the store on."""
    return isinstance(prompt, Chat) and guessed.matched > prompt.last


def within(guessed: Guess, text: str, slot_context: int | None) -> bool:
    """Whether the prompt fits a slot's context: its tail counted at a token a byte (a token is a
    byte at least), what the slot holds at its rate."""
    if slot_context is None:
        return True
    tail = len(text[guessed.matched :].encode())
    return guessed.likely_cached + tail + GENERATION_TOKENS < slot_context
