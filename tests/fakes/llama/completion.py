"""The fake llama-server's completions: ``/completion``, ``/v1/completions``, ``/v1/chat/completions``,
and Anthropic's ``/v1/messages`` and OpenAI's ``/v1/responses`` (converted as llama-server converts
them, supervisor/llama/chatform.py, as patched: ``id_slot`` kept, and templated as chat is).

A reply is its prompt's words echoed (for chat, the last message's), ``n_predict``/``max_tokens`` of
them (16 when unbounded; 4 for Messages and Responses), with ``timings`` and ``usage`` where
llama-server puts them (tests/fakes/llama/replies.py).  ``/completion`` also takes its prompt as token
ids.  ``stream: true`` sends one event per token; the OpenAI endpoints end with ``data: [DONE]``,
llama.cpp's native ``/completion`` does not.  A prompt that leaves the slot no room is refused with
llama-server's ``exceed_context_size_error``.  A completion logs ``arrived`` once it has its slot and
``completion`` when it ends (when it ends well: before the reply's last bytes leave, so a client holding
the whole reply can count on the record being there).
"""

from __future__ import annotations

import os
from typing import Any

from supervisor.errors import ChatFormRefused
from supervisor.llama import chatform

from .core import Core, chatml, content_text, route, token_id
from .replies import (
    Job,
    Sse,
    anthropic,
    anthropic_delta,
    anthropic_end,
    anthropic_start,
    chat_chunk,
    final,
    final_events,
    join,
    responses,
    responses_delta,
    responses_end,
    responses_start,
    token_event,
)
from .steps import Answer, Chunk, Head, HttpError, Pause, Request, Sleep, Whole, dump, event, reply

DEFAULT_PREDICT = 16  # n_predict -1 (unbounded) would never end without an EOS token
AGENT_PREDICT = 4


def _n_predict(body: dict[str, Any], *names: str) -> int:
    for name in names:
        if name in body and body[name] is not None:
            value = body[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < -1:
                raise HttpError(400, f"Field '{name}': Value must be between -1 <= value <= 2147483647, got {value!r}")
            return DEFAULT_PREDICT if value == -1 else value
    return DEFAULT_PREDICT


def parse_job(path: str, body: dict[str, Any], *, token_prompts: bool = True) -> Job:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HttpError(400, "'stream' must be a boolean")
    if path == "/v1/chat/completions":
        prompt = chatml(body.get("messages"))
        echo = content_text(body["messages"][-1].get("content")).split()
        return Job(
            path,
            body,
            prompt,
            echo or ["ok"],
            _n_predict(body, "max_completion_tokens", "max_tokens", "n_predict"),
            stream,
        )
    raw = body.get("prompt")
    names = ("n_predict",) if path == "/completion" else ("max_tokens", "n_predict")
    if (
        token_prompts
        and path == "/completion"
        and isinstance(raw, list)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in raw)
    ):
        return Job(path, body, "", ["ok"], _n_predict(body, *names), stream, tokens=list(raw))
    if path == "/v1/completions" and isinstance(raw, list) and raw and isinstance(raw[0], str):
        raw = raw[0]
    if raw is None:
        raise HttpError(400, "[json.exception.out_of_range.403] key 'prompt' not found")
    if not isinstance(raw, str):
        raise HttpError(400, '"prompt" must be a string')
    return Job(path, body, raw, raw.split() or ["ok"], _n_predict(body, *names), stream)


def held(core: Core, job: Job) -> bool:
    hold = core.modes().hold
    if isinstance(hold, list):
        return any(isinstance(h, str) and h in job.prompt for h in hold)
    return bool(hold)


def _fits(core: Core, prompt: list[int]) -> None:
    n_ctx = core.settings.n_ctx
    if n_ctx is not None and len(prompt) >= n_ctx:
        message = (
            f"request ({len(prompt)} tokens) exceeds the available context size ({n_ctx} tokens), try increasing it"
        )
        raise HttpError(400, message, "exceed_context_size_error", n_prompt_tokens=len(prompt), n_ctx=n_ctx)


class Shape:
    """How one kind of reply is spelled: whole, or as the chunks of a stream."""

    def whole(self, words: list[str], cache_n: int) -> Whole:
        raise NotImplementedError

    def lead(self, cache_n: int) -> list[Chunk]:
        return []

    def word(self, index: int, word: str) -> Chunk:
        raise NotImplementedError

    def tail(self, words: list[str], cache_n: int) -> list[Chunk]:
        return []


def _serve(core: Core, job: Job, prompt: list[int], shape: Shape) -> Answer:
    """One completion on a slot: claim it, answer, and free it (logging the request) exactly once."""
    body = job.body
    claimed = core.claim(body.get("id_slot"), prompt, cache=body.get("cache_prompt", True) is not False)
    job.slot, job.seq, cache_n = claimed.slot, claimed.seq, claimed.cache_n
    job.id = f"{'chatcmpl' if job.chat else 'cmpl'}-fake{os.getpid()}x{job.seq}"
    arrived = {"event": "arrived", "seq": job.seq, "id_slot": body.get("id_slot"), "slot": job.slot}
    core.log({**arrived, "path": job.path, "tokens": prompt, "cache_n": cache_n, "prompt_n": len(prompt) - cache_n})
    if claimed.stale is not None:
        # Decoding from cells that hold another prompt: a wrong answer, as the real decoder gives.
        job.echo = ["stale-kv", *(core.word(t) for t in claimed.stale)]
    words = [job.echo[i % len(job.echo)] for i in range(job.n_predict)]
    sent = 0
    logged = False

    def done(*, finished: bool, disconnected: bool) -> None:
        nonlocal logged
        if logged:
            return
        logged = True
        # A recurrent state holds the reply too, and cannot be cut back to the prompt.
        core.release(job.slot, prompt + [token_id(w) for w in words[:sent]] if core.modes().recurrent else prompt)
        record = {"event": "completion", "seq": job.seq, "path": job.path, "id_slot": body.get("id_slot")}
        record |= {"slot": job.slot, "slot_busy": claimed.busy, "stream": job.stream, "prompt": job.prompt}
        record |= {"n_predict": job.n_predict, "sent": sent, "finished": finished, "disconnected": disconnected}
        core.log({**record, "cache_n": cache_n, "prompt_n": len(prompt) - cache_n})

    try:
        yield Pause(lambda: core.modes().hang)  # no answer at all (a prefill that goes on)
        if not job.stream:
            if words:  # a prefill (nothing to send) is never held
                yield Pause(lambda: held(core, job))
            sent = len(words)
            done(finished=True, disconnected=False)
            yield shape.whole(words, cache_n)
            return
        yield Head()
        yield from shape.lead(cache_n)
        for i, word in enumerate(words):
            delay = core.modes().token_delay_s
            if i and delay:
                yield Sleep(delay)
            yield shape.word(i, word)
            sent += 1
            yield Pause(lambda: held(core, job))
        done(finished=True, disconnected=False)
        yield from shape.tail(words, cache_n)
    except GeneratorExit:
        done(finished=False, disconnected=True)
        raise
    finally:
        done(finished=False, disconnected=False)


class _OpenAI(Shape):
    """llama.cpp's native completion, and OpenAI's completions and chat completions."""

    def __init__(self, alias: str, job: Job, n_prompt: int) -> None:
        self.alias, self.job, self.n_prompt = alias, job, n_prompt

    def whole(self, words: list[str], cache_n: int) -> Whole:
        return reply(200, final(self.alias, self.job, join(self.job, words), cache_n, self.n_prompt, len(words)))

    def lead(self, cache_n: int) -> list[Chunk]:
        role = {"role": "assistant", "content": None}
        return [event(chat_chunk(self.alias, self.job, role, None))] if self.job.chat else []

    def word(self, index: int, word: str) -> Chunk:
        return event(token_event(self.alias, self.job, word, token_id(word), index, self.n_prompt))

    def tail(self, words: list[str], cache_n: int) -> list[Chunk]:
        last = [event(e) for e in final_events(self.alias, self.job, cache_n, self.n_prompt, len(words))]
        return [*last, event("[DONE]")] if self.job.openai else last


@route("POST", "/completion")
@route("POST", "/v1/completions")
@route("POST", "/v1/chat/completions")
def completion(core: Core, request: Request) -> Answer:
    job = parse_job(request.path, request.json(), token_prompts=core.settings.token_prompts)
    if job.tokens is not None:
        prompt = job.tokens
        job.echo = [core.word(t) for t in prompt] or ["ok"]
    else:
        prompt = core.tokenize(job.prompt)
    _fits(core, prompt)
    yield from _serve(core, job, prompt, _OpenAI(core.settings.alias, job, len(prompt)))


def _sse(named: Sse) -> Chunk:
    name, data = named
    return Chunk(f"event: {name}\ndata: ".encode() + dump(data) + b"\n\n")


class _Agent(Shape):
    """Anthropic's Messages or OpenAI's Responses, whole or streamed, with their ``usage``."""

    def __init__(self, path: str, n_prompt: int) -> None:
        self.messages, self.n_prompt = path == chatform.MESSAGES, n_prompt

    def whole(self, words: list[str], cache_n: int) -> Whole:
        return reply(200, (anthropic if self.messages else responses)(words, self.n_prompt, cache_n))

    def lead(self, cache_n: int) -> list[Chunk]:
        return [_sse(anthropic_start(self.n_prompt, cache_n) if self.messages else responses_start())]

    def word(self, index: int, word: str) -> Chunk:
        return _sse(anthropic_delta(word) if self.messages else responses_delta(word))

    def tail(self, words: list[str], cache_n: int) -> list[Chunk]:
        if self.messages:
            return [_sse(named) for named in anthropic_end(len(words))]
        return [_sse(responses_end(words, self.n_prompt, cache_n))]


@route("POST", chatform.MESSAGES)
@route("POST", chatform.RESPONSES)
def agent(core: Core, request: Request) -> Answer:
    """The chat form's last message's words echoed, on a slot as chat's are."""
    body = request.json()
    try:
        chat = chatform.to_chat(request.path, body)
    except ChatFormRefused as exc:
        raise HttpError(400, str(exc)) from None
    prompt_text = chatml(chat.get("messages"))
    echo = content_text(chat["messages"][-1].get("content")).split() or ["ok"]
    job = Job(
        request.path, chat, prompt_text, echo, int(chat.get("max_tokens") or AGENT_PREDICT), body.get("stream") is True
    )
    prompt = core.tokenize(prompt_text)
    _fits(core, prompt)
    yield from _serve(core, job, prompt, _Agent(request.path, len(prompt)))
