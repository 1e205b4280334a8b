"""The exact tokens the decoder will see for a request, so a provider can prefill exactly those.

Chat requests are templated by the decoder itself (``/apply-template``: the same Jinja template,
tools and kwargs its chat endpoint would use), then tokenized by the decoder (``/tokenize`` with the
special-token flags its completion path uses).  A provider never templates or tokenizes on its own.
"""

from __future__ import annotations

from typing import Any

from .. import decoder
from ..decoder import JsonClient, is_token_list

CHAT = "/v1/chat/completions"


def handoff_unsupported(endpoint: str, body: dict[str, Any]) -> str | None:
    """Why this request's prompt cannot be handed over, or None when it can."""
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
    """The prompt's tokens, as the decoder will evaluate them.  Raises DecoderError."""
    if endpoint == CHAT:
        template = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "id_slot")}
        prompt: Any = await decoder.apply_template(client, template)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not is_token_list(prompt):
            prompt = prompt[0]
        if is_token_list(prompt):
            return list(prompt)
    return await decoder.tokenize(client, prompt)
