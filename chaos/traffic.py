"""What a chaos scenario sends and what came back: the prompts, the requests (each with its bound),
and the verdict on each answer, kept in a :class:`Tally` (correct, a clean error, lost, bad).
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import httpx
import trio

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# One request on this model never takes this long; past it, it is lost, not slow.
REQUEST_BOUND_S = 240.0
# Prompts: a short one stays plain (under min_prompt_tokens), a long one goes hybrid.
SHORT = "Say hello."
LONG = (
    "The moon is Earth's only natural satellite. It orbits at an average distance of 384,400 km and "
    "always shows the same face. Write one short sentence about its phases:"
)


def fresh(prompt: str, tag: object) -> str:
    """``prompt`` made new from its first token: no slot holds a prefix of it, so the route is not
    chosen for what a slot already holds (reason ``cached``)."""
    return f"{tag}: {prompt}"


@attrs.define
class Tally:
    sent: int = 0
    ok: int = 0
    clean: int = 0
    lost: int = 0
    bad: int = 0
    hung_up: int = 0  # clients that left on purpose: no answer expected
    notes: list[str] = attrs.Factory(list)
    leftovers: list[str] = attrs.Factory(list)
    figures: dict[str, Any] = attrs.Factory(dict)
    skipped: str = ""  # why the scenario could not run here

    def add(self, verdict: str, note: str = "") -> None:
        self.sent += 1
        if verdict == "ok":
            self.ok += 1
        elif verdict == "clean":
            self.clean += 1
        elif verdict == "lost":
            self.lost += 1
        elif verdict == "hung_up":
            self.hung_up += 1
        else:
            self.bad += 1
        if verdict in ("lost", "bad") and note:
            self.notes.append(f"{verdict}: {note}")

    def check(self, condition: bool, what: str) -> None:
        if not condition:
            self.notes.append(f"failed: {what}")

    @property
    def failed(self) -> bool:
        return bool(self.lost or self.bad or self.leftovers or any(n.startswith("failed") for n in self.notes))


def is_envelope(body: bytes) -> bool:
    try:
        data = json.loads(body)
    except ValueError:
        return False
    error = data.get("error") if isinstance(data, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str)


def judge_whole(status: int, headers: httpx.Headers, body: bytes, tokens: int | None) -> tuple[str, str]:
    if status == 200:
        try:
            data = json.loads(body)
        except ValueError:
            return "bad", "200 with a body that is not JSON"
        got = (data.get("usage") or {}).get("completion_tokens")
        if tokens is not None and got != tokens:
            return "bad", f"200 with {got} tokens, asked for {tokens}"
        return "ok", ""
    if status >= 400 and is_envelope(body):
        if status == 503 and "retry-after" not in headers:
            return "bad", "503 without Retry-After"
        return "clean", ""
    return "bad", f"{status}: {body[:200]!r}"


def judge_events(events: list[str], tokens: int | None) -> tuple[str, str]:
    """A stream's ``data:`` payloads: whole (``[DONE]``, finish_reason), or ended by an error event."""
    if events and events[-1] != "[DONE]":
        try:
            last = json.loads(events[-1])
        except ValueError:
            return "bad", f"a stream ending with {events[-1][:100]!r}"
        if isinstance(last, dict) and "error" in last:
            return "clean", ""
        return "bad", "a stream cut short without an error event"
    if not events:
        return "bad", "an empty stream"
    pieces = 0
    finished = False
    for data in events[:-1]:
        payload = json.loads(data)
        if "error" in payload:
            return "bad", "an error event before [DONE]"
        for choice in payload.get("choices") or []:
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                pieces += 1
            finished = finished or choice.get("finish_reason") is not None
    if not finished or (tokens is not None and pieces == 0):
        return "bad", "a stream without its end"
    return "ok", ""


def body_for(prompt: str, *, stream: bool, tokens: int, chat: bool = False, **extra: Any) -> dict[str, Any]:
    # ignore_eos: the reply has exactly `tokens` tokens, which is how a whole reply is judged correct.
    common = {"max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": stream, **extra}
    if chat:
        return {"messages": [{"role": "user", "content": prompt}], **common}
    return {"prompt": prompt, **common}


async def ask(
    client: httpx.AsyncClient, body: dict[str, Any], *, chat: bool = False, bound: float = REQUEST_BOUND_S
) -> tuple[str, str, int]:
    """Send one request; ``(verdict, note, status)``."""
    path = CHAT if chat else COMPLETIONS
    tokens = body.get("max_tokens")
    status = 0
    with trio.move_on_after(bound):
        try:
            if not body.get("stream"):
                reply = await client.post(path, json=body)
                verdict, note = judge_whole(reply.status_code, reply.headers, reply.content, tokens)
                return verdict, note, reply.status_code
            async with client.stream("POST", path, json=body) as reply:
                status = reply.status_code
                if status != 200:
                    content = await reply.aread()
                    verdict, note = judge_whole(status, reply.headers, content, tokens)
                    return verdict, note, status
                events = [line[5:].strip() async for line in reply.aiter_lines() if line.startswith("data:")]
            verdict, note = judge_events(events, tokens)
            return verdict, note, status
        except httpx.HTTPError as exc:
            return "bad", f"{type(exc).__name__}: {exc}", status
    return "lost", f"no answer within {bound:g}s", status


async def ask_until_ok(
    client: httpx.AsyncClient, tally: Tally, body: dict[str, Any], *, bound: float, chat: bool = False
) -> float:
    """Ask until a correct answer, honouring Retry-After; every try is counted.  The seconds taken."""
    started = trio.current_time()
    with trio.move_on_after(bound):
        while True:
            verdict, note, _ = await ask(client, body, chat=chat, bound=bound)
            tally.add(verdict, note)
            if verdict in ("ok", "lost", "bad"):
                return trio.current_time() - started
            await trio.sleep(1.0)  # Retry-After: 1 (server.retry_after_s)
    tally.add("lost", f"no correct answer within {bound:g}s of retries")
    return trio.current_time() - started


async def ask_and_count(client: httpx.AsyncClient, tally: Tally, body: dict[str, Any]) -> None:
    verdict, note, _ = await ask(client, body)
    tally.add(verdict, note)
