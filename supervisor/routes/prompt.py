"""The exact tokens the decoder will see for a request, so a provider can prefill exactly those.

Chat requests are templated by the decoder itself (``/apply-template``: the same Jinja template,
tools and kwargs its chat endpoint would use), then tokenized by the decoder (``/tokenize`` with the
special-token flags its completion path uses).  A provider never templates or tokenizes on its own.
"""

from __future__ import annotations

from typing import Any

from ..decoder import DecoderClient
from ..errors import DecoderProtocolError

CHAT = "/v1/chat/completions"


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


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
    if isinstance(prompt, str) or _is_token_list(prompt):
        return None
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _is_token_list(prompt[0])):
        return None
    return "not a single prompt"


async def tokens_for(client: DecoderClient, endpoint: str, body: dict[str, Any]) -> list[int]:
    """The prompt's tokens, as the decoder will evaluate them.  Raises DecoderError."""
    if endpoint == CHAT:
        template = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "id_slot")}
        status, data = await client.post_json("/apply-template", template)
        if status != 200 or not isinstance(data, dict) or not isinstance(data.get("prompt"), str):
            raise DecoderProtocolError(f"/apply-template answered {status}", upstream_status=status)
        prompt: Any = data["prompt"]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not _is_token_list(prompt):
            prompt = prompt[0]
        if _is_token_list(prompt):
            return list(prompt)
    status, data = await client.post_json("/tokenize", {"content": prompt, "add_special": True, "parse_special": True})
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if status != 200 or not _is_token_list(tokens):
        raise DecoderProtocolError(f"/tokenize answered {status}", upstream_status=status)
    assert isinstance(tokens, list)
    return tokens
