"""A request's prompt, read once (:func:`parse`), and the exact tokens the decoder will see for it
(:func:`tokens_of`), so a provider can prefill exactly those.

A prompt is one of four values: a chat (its messages, templated by the decoder), a text, tokens, or a
shape no provider takes (with why).  Anthropic's ``/v1/messages`` and OpenAI's ``/v1/responses`` are
first put in the chat form llama-server makes of them (supervisor/llama/chatform.py), then read as
chat; a body llama-server will not convert is unsupported, ``refused``.  Every prompt keeps its text
for slot affinity (:attr:`Chat.text`), read without a round trip to the tokenizer.

Chat requests are templated by the decoder itself (``/apply-template``: the same Jinja template, tools
and kwargs its chat endpoint would use), then tokenized by the decoder (``/tokenize`` with the
special-token flags its completion path uses).  A provider never templates or tokenizes on its own.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from ..errors import ChatFormRefused
from ..llama import chatform, decoder
from ..llama.decoder import JsonClient, is_token_list

CHAT = "/v1/chat/completions"
MESSAGES = chatform.MESSAGES
RESPONSES = chatform.RESPONSES


@attrs.frozen
class Chat:
    """A chat, in the form llama-server's chat endpoint reads (a Messages or Responses one converted)."""

    body: dict[str, Any]
    text: str  # its messages as JSON: the slot affinity key's text

    @property
    def last(self) -> int:
        """Where its last message begins in ``text`` (0: none): a prefix the prefix store keeps of a
        chat ends where some earlier request's messages ended (routes/boundary.py), before this
        point.  The list's JSON is "[", its messages' joined by ",", then "]"."""
        messages = self.body["messages"]
        return len(self.text) - 1 - len(_json(messages[-1])) if messages else 0


@attrs.frozen
class Text:
    """One prompt as a string (``prompt``, or a list of one)."""

    prompt: str
    text: str


@attrs.frozen
class Tokens:
    """One prompt as token ids (``prompt``, or a list of one)."""

    tokens: tuple[int, ...]
    text: str


@attrs.frozen
class Unsupported:
    """A prompt no provider takes, and why (not tokenized: the decoder prefills it)."""

    why: str
    text: str
    # A Messages or Responses body llama-server will not convert: it refuses it too, with its own
    # 400, which is relayed.
    refused: bool = False


Prompt = Chat | Text | Tokens | Unsupported


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def parse(endpoint: str, body: dict[str, Any]) -> Prompt:
    """The prompt of a completion request to ``endpoint``, read once."""
    if endpoint in chatform.ENDPOINTS:
        try:
            body = chatform.to_chat(endpoint, body)
        except ChatFormRefused as exc:
            field = "input" if endpoint == RESPONSES else "messages"
            return Unsupported(str(exc), _json(body.get(field)), refused=True)
        endpoint = CHAT
    if endpoint == CHAT:
        return _chat(body)
    prompt = body.get("prompt")
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, separators=(",", ":"))
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or is_token_list(prompt[0])):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return Text(prompt, text)
    if isinstance(prompt, list) and is_token_list(prompt):
        return Tokens(tuple(prompt), text)
    return Unsupported("not a single prompt", text)


def _chat(body: dict[str, Any]) -> Chat | Unsupported:
    messages = body.get("messages")
    text = _json(messages)
    if not isinstance(messages, list):
        return Unsupported("no messages", text)
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            not (isinstance(part, dict) and part.get("type") == "text") for part in content
        ):
            return Unsupported("non-text message content", text)
    return Chat(body, text)


def template(chat: Chat, **changes: Any) -> dict[str, Any]:
    """What ``/apply-template`` is given for a chat: its body less what only the completion reads."""
    kept = {k: v for k, v in chat.body.items() if k not in ("stream", "stream_options", "id_slot", "cache_prompt")}
    return {**kept, **changes}


async def tokens_of(client: JsonClient, prompt: Chat | Text | Tokens) -> list[int]:
    """The prompt's tokens, as the decoder will evaluate them.  Raises DecoderError."""
    if isinstance(prompt, Tokens):
        return list(prompt.tokens)
    if isinstance(prompt, Text):
        return await decoder.tokenize(client, prompt.prompt)
    return await decoder.tokenize(client, await decoder.apply_template(client, template(prompt)))
