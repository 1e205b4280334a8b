"""The exact tokens the decoder will see for a request, so a provider can prefill exactly those.

Chat requests are templated by the decoder itself (``/apply-template``: the same Jinja template,
tools and kwargs its chat endpoint would use), then tokenized by the decoder (``/tokenize`` with the
special-token flags its completion path uses).  Anthropic's ``/v1/messages`` and OpenAI's
``/v1/responses`` are first put in the chat form llama-server makes of them (supervisor/llama/chatform.py,
:func:`chat_form`), then read as chat.  A provider never templates or tokenizes on its own.
"""

from __future__ import annotations

from typing import Any

from ..llama import chatform, decoder
from ..llama.decoder import JsonClient, is_token_list

CHAT = "/v1/chat/completions"
MESSAGES = chatform.MESSAGES
RESPONSES = chatform.RESPONSES


def chat_form(endpoint: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The endpoint and body the rest of this module reads: a Messages or Responses request as the
    chat request llama-server converts it into, anything else as it is.  Raises ChatFormRefused."""
    if endpoint in chatform.ENDPOINTS:
        return CHAT, chatform.to_chat(endpoint, body)
    return endpoint, body


def handoff_unsupported(endpoint: str, body: dict[str, Any]) -> str | None:
    """Why this request's prompt cannot be handed over, or None when it can (``endpoint`` and
    ``body`` in :func:`chat_form`)."""
    if endpoint == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return "no messages"
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(
                not (isinstance(part, dict) and part.get("type") == "text") for part in content
            ):
                return "non-text message content"
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, str) or is_token_list(prompt):
        return None
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or is_token_list(prompt[0])):
        return None
    return "not a single prompt"


async def tokens_for(client: JsonClient, endpoint: str, body: dict[str, Any]) -> list[int]:
    """The prompt's tokens, as the decoder will evaluate them (``endpoint`` and ``body`` in
    :func:`chat_form`).  Raises DecoderError."""
    if endpoint == CHAT:
        template = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "id_slot", "cache_prompt")}
        prompt: Any = await decoder.apply_template(client, template)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not is_token_list(prompt):
            prompt = prompt[0]
        if is_token_list(prompt):
            return list(prompt)
    return await decoder.tokenize(client, prompt)
