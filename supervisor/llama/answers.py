"""What llama-server answers, as values: a refusal in its own words, a save's count, a prefill's and
a next token's timings, a slot's real context.  Pure: supervisor/llama/decoder.py asks, these hold
the answers (and :func:`slot_context` reads one from ``/props`` and ``/v1/models`` bodies)."""

from __future__ import annotations

import json
from typing import Any

import attrs

from ..errors import DecoderError

# How much of an answer that is not llama-server's error object a refusal quotes.
_QUOTED = 300


def error_message(data: Any) -> str | None:
    """llama-server's words in an error answer (``{"error": {"message": ...}}``), or None."""
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return None


def error_type(data: Any) -> str | None:
    """llama-server's kind of error in an error answer (``{"error": {"type": ...}}``:
    ``invalid_request_error``, ``exceed_context_size_error``, ``server_error``...), or None."""
    error = data.get("error") if isinstance(data, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    return kind if isinstance(kind, str) else None


@attrs.frozen
class Refusal:
    """llama-server did not do what it was asked: ``what`` says how (``restore answered 400``), and
    ``status`` and ``data`` are its answer (status 0: it gave none, ``data`` then holds our words)."""

    what: str
    status: int
    data: Any

    @classmethod
    def unanswered(cls, what: str, exc: DecoderError) -> Refusal:
        return cls(f"{what} answered 0", 0, {"error": {"message": exc.message}})

    @property
    def words(self) -> str:
        """llama-server's own words for it: its error message, else the start of its answer."""
        message = error_message(self.data)
        return message if message is not None else str(self.data)[:_QUOTED]

    @property
    def answer(self) -> str:
        """The whole answer, as JSON (for an answer whose other fields tell more than its message)."""
        return json.dumps(self.data) if self.data is not None else f"status {self.status}"

    def __str__(self) -> str:
        return f"{self.what}: {self.words}"


@attrs.frozen
class Saved:
    n_saved: int | None  # the tokens the file holds, where llama-server said


@attrs.frozen
class Evaluated:
    prompt_n: int | None  # the prompt tokens it evaluated (its cache held the rest)
    prompt_ms: float | None


@attrs.frozen
class NextToken:
    """The answer to a one-token completion: llama-server's whole reply (its ``completion_probabilities``
    for a reader of the distribution) and how many prompt tokens it evaluated to give it, in how long."""

    reply: Any
    prompt_n: int | None
    prompt_ms: float | None = None


@attrs.frozen
class SlotContext:
    """What one slot of a running llama-server holds, as it says: ``n_ctx`` tokens a slot (its
    ``/props`` ``default_generation_settings.n_ctx``: ``min(ctx_size / parallel, n_ctx_train)``),
    the model's training context (``/v1/models``' ``meta.n_ctx_train``) and its slot count."""

    n_ctx: int
    n_ctx_train: int | None
    slots: int | None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def slot_context(props: Any, models: Any) -> SlotContext | None:
    """A slot's context from llama-server's ``GET /props`` and ``GET /v1/models`` bodies; None when
    ``/props`` does not say it."""
    settings = props.get("default_generation_settings") if isinstance(props, dict) else None
    n_ctx = _int(settings.get("n_ctx")) if isinstance(settings, dict) else None
    if n_ctx is None:
        return None
    train = None
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("meta"), dict):
        train = _int(data[0]["meta"].get("n_ctx_train"))
    return SlotContext(n_ctx=n_ctx, n_ctx_train=train, slots=_int(props.get("total_slots")))
