"""A steady load of chat completions, streamed and whole, through a balancer; every reply checked.

A reply counts as good only when it is complete and well formed: a whole reply is a 200 with a
choice, its message and a ``finish_reason``; a stream is a 200 whose every event parses, one of
which carries the ``finish_reason``, ending with ``[DONE]``.  Anything else is a failure, and a
stream that began (200) but did not end that way is a truncated one.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from typing import Any

import attrs
import httpx
import trio

CHAT = "/v1/chat/completions"
# Short replies: the load is there to be in flight during drains, not to measure the decoder.
WHOLE_TOKENS, STREAM_TOKENS = 4, 6


@attrs.frozen
class Outcome:
    kind: str  # "stream" or "whole"
    elapsed_s: float
    host: str  # the balancer's answer to "who served it" (a response header)
    problem: str | None  # None: a complete, correct reply
    truncated: bool = False


def check_whole(reply: httpx.Response) -> str | None:
    if reply.status_code != 200:
        return f"status {reply.status_code}: {reply.text[:300]}"
    try:
        body = reply.json()
        choice = body["choices"][0]
        if not isinstance(choice["message"]["content"], str):
            return f"no text: {body}"
        if choice["finish_reason"] not in ("stop", "length"):
            return f"finish_reason {choice['finish_reason']!r}"
        if body["usage"]["completion_tokens"] < 1:
            return f"no tokens: {body['usage']}"
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return f"malformed reply ({exc!r}): {reply.text[:300]}"
    return None


def check_stream(events: list[str]) -> str | None:
    """None for a complete stream; else what is wrong with it."""
    if not events or events[-1] != "[DONE]":
        return f"no [DONE] after {len(events)} events"
    finishes = []
    for data in events[:-1]:
        try:
            chunk = json.loads(data)
        except ValueError:
            return f"an event that is not JSON: {data[:200]!r}"
        if "error" in chunk:
            return f"an error event: {data[:300]}"
        # llama-server's last chunk may carry only usage and timings, no choice.
        finishes += [c["finish_reason"] for c in chunk.get("choices", []) if c.get("finish_reason")]
    if len(finishes) != 1 or finishes[0] not in ("stop", "length"):
        return f"finish reasons {finishes}"
    return None


def has_text(data: str) -> bool:
    """Whether a stream event carries generated text (the first one carries only the role)."""
    if data == "[DONE]":
        return False
    try:
        choices = json.loads(data).get("choices") or []
    except ValueError:
        return False
    return any((c.get("delta") or {}).get("content") for c in choices)


class Load:
    """``workers`` clients, each sending one request after another until :meth:`stop`.

    Each request carries its own X-Session-Id, so a hashing balancer spreads them over its hosts.
    ``served_by(reply)`` names the host from the balancer's response header."""

    def __init__(self, client: httpx.AsyncClient, *, workers: int, host_header: str) -> None:
        self.client = client
        self.workers = workers
        self.host_header = host_header
        self.outcomes: list[Outcome] = []
        self._numbers = itertools.count()
        self._stopping = False
        self._changed = trio.Event()

    def stop(self) -> None:
        self._stopping = True

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(self.workers):
                nursery.start_soon(self._worker)
            task_status.started()

    async def wait_finished(self, n: int) -> None:
        while len(self.outcomes) < n:
            await self._changed.wait()

    async def wait_served_by(self, host: str, after: int) -> None:
        """Until a good reply from ``host`` among the requests finished after the first ``after``."""
        while not any(o.host == host and o.problem is None for o in self.outcomes[after:]):
            await self._changed.wait()

    async def _worker(self) -> None:
        while not self._stopping:
            n = next(self._numbers)
            body: dict[str, Any] = {
                "messages": [{"role": "user", "content": f"Say something about the number {n}."}],
                "temperature": 0,
                "stream": n % 2 == 0,
                "max_tokens": STREAM_TOKENS if n % 2 == 0 else WHOLE_TOKENS,
            }
            headers = {"x-session-id": f"load-{n}"}
            started = trio.current_time()
            try:
                if body["stream"]:
                    outcome = await self._stream(body, headers, started)
                else:
                    reply = await self.client.post(CHAT, json=body, headers=headers)
                    outcome = Outcome(
                        "whole",
                        trio.current_time() - started,
                        reply.headers.get(self.host_header, "?"),
                        check_whole(reply),
                    )
            except httpx.HTTPError as exc:
                kind = "stream" if body["stream"] else "whole"
                outcome = Outcome(kind, trio.current_time() - started, "?", f"{type(exc).__name__}: {exc}")
            self.outcomes.append(outcome)
            self._changed.set()
            self._changed = trio.Event()

    async def _stream(self, body: dict[str, Any], headers: dict[str, str], started: float) -> Outcome:
        events: list[str] = []
        async with self.client.stream("POST", CHAT, json=body, headers=headers) as reply:
            host = reply.headers.get(self.host_header, "?")
            if reply.status_code != 200:
                await reply.aread()
                return Outcome(
                    "stream", trio.current_time() - started, host, f"status {reply.status_code}: {reply.text}"
                )
            try:
                async for line in reply.aiter_lines():
                    if line.startswith("data:"):
                        events.append(line[5:].strip())
            except httpx.HTTPError as exc:
                broken = f"{type(exc).__name__} after {len(events)} events: {exc}"
                return Outcome("stream", trio.current_time() - started, host, broken, truncated=True)
        problem = check_stream(events)
        return Outcome("stream", trio.current_time() - started, host, problem, truncated=problem is not None)

    # -- the figures --------------------------------------------------------------------------------

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.problem is not None]

    def figures(self) -> dict[str, Any]:
        return {
            "requests": len(self.outcomes),
            "streamed": sum(o.kind == "stream" for o in self.outcomes),
            "whole": sum(o.kind == "whole" for o in self.outcomes),
            "failed": len(self.failed()),
            "truncated": sum(o.truncated for o in self.outcomes),
            "longest_wait_s": round(max((o.elapsed_s for o in self.outcomes), default=0.0), 3),
            "by_host": dict(Counter(o.host for o in self.outcomes)),
        }


class LongStream:
    """One streamed chat of exactly ``max_tokens`` tokens (``ignore_eos``) for session ``session``:
    long enough to be still in flight when a test drains the host that serves it.  The drain is an
    ``onebitctl`` process, whose start-up alone took over 2 s on a busy 2-CPU machine: 48 tokens
    were once over before it reached onebitd ("draining: 0 in flight", tests/unit/deploy/test_nginx.py)."""

    def __init__(self, client: httpx.AsyncClient, session: str, *, host_header: str, max_tokens: int = 256) -> None:
        self.client = client
        self.session = session
        self.host_header = host_header
        self.max_tokens = max_tokens
        self.first = trio.Event()
        self.outcome: Outcome | None = None

    async def run(self) -> None:
        body = {
            "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
            "temperature": 0,
            "stream": True,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
        }
        started = trio.current_time()
        events: list[str] = []
        host: str = "?"
        problem: str | None = None
        try:
            async with self.client.stream("POST", CHAT, json=body, headers={"x-session-id": self.session}) as reply:
                host = reply.headers.get(self.host_header, "?")
                if reply.status_code != 200:
                    problem = f"status {reply.status_code}: {(await reply.aread())[:300]!r}"
                else:
                    async for line in reply.aiter_lines():
                        if line.startswith("data:"):
                            events.append(line[5:].strip())
                            if has_text(events[-1]):
                                self.first.set()
                    problem = check_stream(events)
        except httpx.HTTPError as exc:
            problem = f"{type(exc).__name__} after {len(events)} events: {exc}"
        finally:
            truncated = problem is not None and bool(events)
            self.outcome = Outcome("stream", trio.current_time() - started, host, problem, truncated=truncated)
            self.first.set()
