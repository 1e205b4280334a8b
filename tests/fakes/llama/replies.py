"""A completion's reply in llama-server's shapes, pure: llama.cpp's native ``/completion``, OpenAI's
completions and chat completions (whole, or as stream events), Anthropic's Messages and OpenAI's
Responses (tests/fakes/llama/completion.py decides what to say; this module only spells it)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .core import timings


@dataclass
class Job:
    """A completion request, validated: what to say and how to frame it."""

    path: str
    body: dict[str, Any]
    prompt: str  # what is tokenized (for chat: the templated conversation)
    echo: list[str]  # the words the reply repeats
    n_predict: int
    stream: bool
    tokens: list[int] | None = None  # a prompt given as token ids
    seq: int = 0
    slot: int = 0
    id: str = ""

    @property
    def openai(self) -> bool:
        return self.path != "/completion"

    @property
    def chat(self) -> bool:
        return self.path == "/v1/chat/completions"


def join(job: Job, words: list[str]) -> str:
    text = " ".join(words)
    return text if job.chat else " " + text


def _piece(job: Job, word: str, index: int) -> str:
    return word if job.chat and index == 0 else " " + word


def chat_chunk(alias: str, job: Job, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {
        "choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
        "created": int(time.time()),
        "id": job.id,
        "model": alias,
        "system_fingerprint": "b0-fake",
        "object": "chat.completion.chunk",
    }


def token_event(alias: str, job: Job, word: str, token: int, index: int, n_prompt: int) -> dict[str, Any]:
    piece = _piece(job, word, index)
    if job.chat:
        return chat_chunk(alias, job, {"content": piece}, None)
    if job.openai:
        return {
            "choices": [{"text": piece, "index": 0, "logprobs": None, "finish_reason": None}],
            "created": int(time.time()),
            "model": alias,
            "system_fingerprint": "b0-fake",
            "object": "text_completion",
            "id": job.id,
        }
    return {
        "index": 0,
        "content": piece,
        "tokens": [token],
        "stop": False,
        "id_slot": -1,
        "tokens_predicted": index + 1,
        "tokens_evaluated": n_prompt,
    }


def _usage(cache_n: int, n_prompt: int, n_out: int) -> dict[str, Any]:
    return {
        "completion_tokens": n_out,
        "prompt_tokens": n_prompt,
        "total_tokens": n_prompt + n_out,
        "prompt_tokens_details": {"cached_tokens": cache_n},
    }


def final_events(alias: str, job: Job, cache_n: int, n_prompt: int, n_out: int) -> list[dict[str, Any]]:
    """A stream's last events (before ``[DONE]``), the last one with ``timings``: for chat, the chunk
    with the finish reason and, when ``stream_options.include_usage`` asks for it, one with no
    choices and the ``usage`` (server-task.cpp's ``to_json_oaicompat_chat_stream``)."""
    last = final(alias, job, "", cache_n, n_prompt, n_out)
    options = job.body.get("stream_options")
    if not (job.chat and isinstance(options, dict) and options.get("include_usage") is True):
        return [last]
    t = last.pop("timings")
    usage = {**chat_chunk(alias, job, {}, None), "choices": [], "usage": _usage(cache_n, n_prompt, n_out)}
    return [last, {**usage, "timings": t}]


def final(alias: str, job: Job, text: str, cache_n: int, n_prompt: int, n_out: int) -> dict[str, Any]:
    """The whole reply, or (``text`` empty) a stream's last event: both carry ``timings``."""
    t = timings(cache_n, n_prompt - cache_n, n_out)
    if not job.openai:
        return {
            "index": 0,
            "content": text,
            "tokens": [],
            "id_slot": job.slot,
            "stop": True,
            "model": alias,
            "tokens_predicted": n_out,
            "tokens_evaluated": n_prompt,
            "generation_settings": {"n_predict": job.n_predict, "stream": job.stream},
            "prompt": job.prompt,
            "has_new_line": "\n" in text,
            "truncated": False,
            "stop_type": "limit",
            "stopping_word": "",
            "tokens_cached": n_prompt + n_out,
            "timings": t,
        }
    if job.chat and job.stream:
        return {**chat_chunk(alias, job, {}, "length"), "timings": t}
    common = {"created": int(time.time()), "model": alias, "system_fingerprint": "b0-fake"}
    if job.chat:
        choice: dict[str, Any] = {
            "finish_reason": "length",
            "index": 0,
            "message": {"role": "assistant", "content": text},
        }
        kind = "chat.completion"
    else:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": "length"}
        kind = "text_completion"
    usage = _usage(cache_n, n_prompt, n_out)
    return {"choices": [choice], **common, "object": kind, "usage": usage, "id": job.id, "timings": t}


# -- Anthropic's Messages and OpenAI's Responses: (event name, data) for a stream's events ----------

Sse = tuple[str, dict[str, Any]]


def _anthropic_usage(n_out: int, n_prompt: int, cache_n: int) -> dict[str, Any]:
    """No ``timings`` in Anthropic's shape: ``usage`` says what was evaluated and reused."""
    return {"cache_read_input_tokens": cache_n, "input_tokens": n_prompt - cache_n, "output_tokens": n_out}


def anthropic(out: list[str], n_prompt: int, cache_n: int) -> dict[str, Any]:
    content = [{"type": "text", "text": " ".join(out)}]
    usage = _anthropic_usage(len(out), n_prompt, cache_n)
    return {
        "id": "msg_fake",
        "type": "message",
        "role": "assistant",
        "content": content,
        "usage": usage,
        "stop_reason": "max_tokens",
    }


def anthropic_start(n_prompt: int, cache_n: int) -> Sse:
    start = {"id": "msg_fake", "type": "message", "role": "assistant", "content": []}
    return "message_start", {
        "type": "message_start",
        "message": {**start, "usage": _anthropic_usage(0, n_prompt, cache_n)},
    }


def anthropic_delta(word: str) -> Sse:
    return "content_block_delta", {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": word},
    }


def anthropic_end(n_out: int) -> list[Sse]:
    stop = {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": n_out}}
    return [("message_delta", stop), ("message_stop", {"type": "message_stop"})]


def responses(out: list[str], n_prompt: int, cache_n: int) -> dict[str, Any]:
    """``usage`` whole; a stream's last event carries ``timings`` too."""
    usage = {
        "input_tokens": n_prompt,
        "output_tokens": len(out),
        "total_tokens": n_prompt + len(out),
        "input_tokens_details": {"cached_tokens": cache_n},
    }
    item = {"id": "msg_fake", "type": "message", "role": "assistant", "status": "completed"}
    output = [{**item, "content": [{"type": "output_text", "text": " ".join(out), "annotations": []}]}]
    return {"id": "resp_fake", "object": "response", "status": "completed", "output": output, "usage": usage}


def responses_start() -> Sse:
    return "response.created", {"type": "response.created", "response": {"id": "resp_fake"}}


def responses_delta(word: str) -> Sse:
    return "response.output_text.delta", {"type": "response.output_text.delta", "delta": word}


def responses_end(out: list[str], n_prompt: int, cache_n: int) -> Sse:
    completed = {"type": "response.completed", "response": responses(out, n_prompt, cache_n)}
    return "response.completed", {**completed, "timings": timings(cache_n, n_prompt - cache_n, len(out))}
