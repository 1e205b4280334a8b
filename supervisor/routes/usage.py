"""The usage a client is told: a prompt this request prefilled is not a cache hit.

After a handoff (the file or share route) the decoder's slot holds the state a provider computed
for the prompt, and llama-server counts every token of it as reused from its cache: ``cache_n`` in
``timings``, ``prompt_tokens_details.cached_tokens`` in OpenAI's ``usage``,
``input_tokens_details.cached_tokens`` in the Responses API's, ``cache_read_input_tokens`` in
Anthropic's.  A client that accounts for cache hits (a cost tracker, Claude Code, opencode) would
book a fresh prefill as one.  :class:`Prefill` rewrites those counts in the decoder's reply:
the tokens the provider evaluated for this request are taken out of the cached count (Anthropic's
``input_tokens``, which excludes cache reads, gets them back); what stays cached is what a cache
truly served: the provider's own prompt cache on a handoff (a slot's earlier contents are
overwritten by the handed-over state).  Every ``timings`` object keeps llama-server's fields and
gains onebitd's: ``onebit_provider_prompt_n`` and ``onebit_provider_prompt_ms``, what the provider
spent, from the handoff that worked (routes/handover.py's ``Walk.prefilled``; the route line
tells them as ``provider_prompt_n`` and ``prefill_ms``).

A hybrid model's plain request is two calls to the decoder (routes/boundary.py): a prefill up to
the prompt's boundary, saved for the prefix store, then the rest, whose reply counts the first call's
tokens as cached.  Its reply is rewritten the same way, the first call's tokens and time folded into
``timings``' own ``prompt_n``, ``prompt_ms`` and ``cache_n`` (the same decoder did them).

Only those replies are rewritten; any other plain one (a slot that held a prefix, a prefix store
restore) is relayed as it came, its counts true as llama-server gives them.  Only the JSON that
can carry the counts is parsed: a whole reply, and in a stream the ``data:`` lines that mention
``usage`` or ``timings`` (llama-server's last event or two); every other byte passes as it came.
"""

from __future__ import annotations

import json
from typing import Any, TypeGuard

import attrs

# onebitd's own fields in a reply's ``timings``.
PROVIDER_PROMPT_N = "onebit_provider_prompt_n"
PROVIDER_PROMPT_MS = "onebit_provider_prompt_ms"

# Where a count can be, in a whole reply or one event: the object itself (OpenAI's replies and
# chunks, Anthropic's message and message_delta), Anthropic's message_start ``message``, and the
# Responses API's response.completed ``response``.
_HOLDERS = (None, "message", "response")
_DETAILS = ("prompt_tokens_details", "input_tokens_details")
# The words a stream's line must hold to be parsed (an event's key, in its quotes: a model's
# ``"usage"`` inside a string is escaped, ``\"usage\"``, and does not match).
_WORDS = (b'"usage"', b'"timings"')


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _encode(data: Any) -> bytes:
    """JSON as llama-server writes it: no spaces, UTF-8 as is.  (A lone surrogate, which UTF-8
    cannot hold, is written back as the ``\\udXXX`` escape it was read from.)"""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")


@attrs.frozen
class Prefill:
    """What this request prefilled before the decoder's reply was asked for: a provider's handoff,
    or (``provider`` false) the decoder's own prefill to a hybrid model's boundary.  The reply's usage
    is rewritten with it."""

    evaluated: int | None  # prompt tokens evaluated (a cache held the rest); None: all it counted
    prefill_ms: float | None  # the prefill's time
    provider: bool = True

    def cached(self, counted: int) -> int:
        """Of the ``counted`` prompt tokens the decoder says it reused, those a cache served."""
        if self.evaluated is None:
            return 0
        return max(0, counted - self.evaluated)

    def rewrite(self, data: Any) -> bool:
        """Rewrite the counts in one reply or event (a decoded JSON value), in place; whether any was."""
        if not isinstance(data, dict):
            return False
        changed = False
        for name in _HOLDERS:
            holder = data if name is None else data.get(name)
            if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
                changed |= self._usage(holder["usage"])
        timings = data.get("timings")
        if isinstance(timings, dict):
            changed |= self._timings(timings) if self.provider else self._decoder_timings(timings)
        return changed

    def _timings(self, timings: dict[str, Any]) -> bool:
        cache_n = timings.get("cache_n")
        evaluated = self.evaluated if self.evaluated is not None else cache_n
        if _is_int(evaluated):
            timings[PROVIDER_PROMPT_N] = evaluated
        if self.prefill_ms is not None:
            timings[PROVIDER_PROMPT_MS] = self.prefill_ms
        return True

    def _decoder_timings(self, timings: dict[str, Any]) -> bool:
        """The decoder's first call is its own work: counted in its prompt, out of its cache."""
        evaluated, cache_n, prompt_n = self.evaluated, timings.get("cache_n"), timings.get("prompt_n")
        if not (_is_int(evaluated) and _is_int(cache_n) and _is_int(prompt_n)):
            return False
        moved = min(evaluated, cache_n)
        timings["cache_n"], timings["prompt_n"] = cache_n - moved, prompt_n + moved
        prompt_ms = timings.get("prompt_ms")
        if self.prefill_ms is not None and isinstance(prompt_ms, (int, float)) and not isinstance(prompt_ms, bool):
            timings["prompt_ms"] = prompt_ms + self.prefill_ms
        return True

    def _usage(self, usage: dict[str, Any]) -> bool:
        changed = False
        for name in _DETAILS:  # OpenAI's chat and completions, the Responses API's
            details = usage.get(name)
            if isinstance(details, dict) and _is_int(details.get("cached_tokens")):
                details["cached_tokens"] = self.cached(details["cached_tokens"])
                changed = True
        read = usage.get("cache_read_input_tokens")  # Anthropic's: input_tokens counts the rest
        if _is_int(read):
            kept = self.cached(read)
            usage["cache_read_input_tokens"] = kept
            if _is_int(usage.get("input_tokens")):
                usage["input_tokens"] += read - kept
            changed = True
        return changed

    def reply(self, body: bytes, data: Any) -> bytes:
        """A whole reply's ``body`` (``data``, as decoded) with its counts rewritten."""
        return _encode(data) if self.rewrite(data) else body

    def stream(self) -> StreamUsage:
        return StreamUsage(self)


class StreamUsage:
    """A stream's chunks with their counts rewritten.  A chunk that ends a line and mentions neither
    word passes as it is; otherwise what follows the chunk's last newline is held until the rest of
    its line comes (a line cut between chunks is parsed whole)."""

    def __init__(self, prefill: Prefill) -> None:
        self._prefill = prefill
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        """What of the stream to send now (maybe nothing)."""
        if not self._held and chunk.endswith(b"\n") and all(chunk.rfind(word) < 0 for word in _WORDS):
            return chunk  # the common chunk: whole token events
        data = self._held + chunk
        end = data.rfind(b"\n") + 1
        self._held = data[end:]
        whole = data[:end]
        if all(word not in whole for word in _WORDS):
            return whole
        return b"\n".join(self._line(line) for line in whole.split(b"\n"))

    def flush(self) -> bytes:
        """What is still held when the stream ends (a last line with no newline)."""
        held, self._held = self._held, b""
        return self._line(held) if held else b""

    def _line(self, line: bytes) -> bytes:
        if not line.startswith(b"data:") or all(word not in line for word in _WORDS):
            return line
        lead = b"data: " if line.startswith(b"data: ") else b"data:"
        end = b"\r" if line.endswith(b"\r") else b""
        try:
            data = json.loads(line[5:])
        except ValueError:
            return line
        return lead + _encode(data) + end if self._prefill.rewrite(data) else line
