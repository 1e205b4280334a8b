"""The llama-server client: llama-server's HTTP API over its unix socket.

:class:`DecoderClient` is how onebitd talks to every llama-server it runs (the decoder, a llama
provider), over supervisor/http/wire.py's HTTP/1.1, which raises only :class:`~supervisor.errors.DecoderError`
and keeps the only keep-alive pool and the only resend (of a request a pooled connection dropped
unanswered) onebitd has.

The calls onebitd makes of llama-server's own API are spelled here and nowhere else
(tests/unit/llama/test_llama_paths.py holds it so): :meth:`DecoderClient.healthy`, :func:`restore`,
:func:`save`, :func:`erase`, :func:`share`, :func:`adopt`, :func:`prefill`, :func:`next_token`,
:func:`tokenize` and :func:`apply_template` take any :class:`JsonClient` (a DecoderClient; a fake in
tests) and return their value, or a :class:`Refusal` carrying llama-server's words (the slot calls
never raise for the decoder: no answer at all is a refusal with status 0); :func:`slot_busy` (and
:func:`wait_slot_idle`, which polls it), :func:`delete_stream` and :func:`decoder_metrics` take a
DecoderClient.  What the front relays for a client goes through :meth:`DecoderClient.request` and
:meth:`DecoderClient.stream` under the client's own path (supervisor/api/endpoints.py's table).

Clients that talk to a llama-server directly, beside onebitd (the benchmarks' baseline, the tests'
references), are httpx on supervisor/testing.py's ``unix_transport``, held to the same keep-alive
rules; onebitd itself does not import httpx.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import attrs
import trio

from ..errors import DecoderError, DecoderProtocolError
from ..http import wire
from .answers import Evaluated as Evaluated
from .answers import NextToken as NextToken
from .answers import Refusal as Refusal
from .answers import Saved as Saved
from .answers import SlotContext as SlotContext
from .answers import error_message as error_message
from .answers import error_type as error_type
from .answers import slot_context

# A reply's read has no time limit: generation has no natural upper bound (a long reply on a slow
# CPU); a stuck decoder is caught by the health check, which gives one answer this long.
_HEALTH_TIMEOUT_S = 5.0


@attrs.frozen
class Reply:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            raise DecoderProtocolError(
                f"decoder answered {self.status} with a body that is not JSON", upstream_status=self.status
            ) from None


@attrs.frozen
class Stream:
    status: int
    headers: Mapping[str, str]
    chunks: AsyncIterator[bytes]


class DecoderClient:
    """Talks to one llama-server on ``socket``.  Close with :meth:`aclose`.

    The bytes go through ``transport``: :class:`~supervisor.http.wire.UnixTransport` on ``socket`` unless
    one is given (httpx's ``MockTransport`` style): the tests hand it an in-process fake llama-server
    (tests/fakes/llama/inprocess.py) and need no process at all."""

    def __init__(self, socket: Path, *, max_connections: int = 64, transport: wire.Transport | None = None) -> None:
        self.socket = socket
        self._transport = transport or wire.UnixTransport(socket, max_connections=max_connections)

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def healthy(self) -> bool:
        with trio.move_on_after(_HEALTH_TIMEOUT_S):
            try:
                response = await self._transport.send("GET", "/health", None)
                try:
                    await response.read()
                finally:
                    await response.aclose()
            except DecoderError:
                return False
            return response.status == 200
        return False

    @staticmethod
    def _encode(body: Any) -> bytes | None:
        return None if body is None else json.dumps(body).encode()

    async def request(self, method: str, path: str, body: Any = None, headers: wire.Headers = ()) -> Reply:
        """One request; the whole reply.  ``body`` is sent as JSON when not None."""
        response = await self._transport.send(method, path, self._encode(body), headers)
        try:
            content = await response.read()
        finally:
            await response.aclose()
        return Reply(response.status, response.headers, content)

    async def post_json(self, path: str, body: Any) -> tuple[int, Any]:
        """POST JSON, expect JSON back (any status); returns ``(status, decoded body)``."""
        reply = await self.request("POST", path, body)
        return reply.status, reply.json()

    @asynccontextmanager
    async def stream(
        self, path: str, body: Any, headers: wire.Headers = (), *, method: str = "POST"
    ) -> AsyncIterator[Stream]:
        """POST (or ``method``) and relay the reply as it comes.  Leaving the block closes the
        connection (unless the reply was read to its end), which makes llama-server stop working on
        the request (one that carries ``X-Conversation-Id`` goes on into its stream session)."""
        response = await self._transport.send(method, path, self._encode(body), headers)
        chunks = response.chunks()
        try:
            yield Stream(response.status, response.headers, chunks)
        finally:
            try:
                await chunks.aclose()
            finally:
                await response.aclose()


# -- llama-server's API, typed ------------------------------------------------------------------------


class JsonClient(Protocol):
    """What the typed calls need of a client: :meth:`DecoderClient.post_json` (a fake in tests)."""

    async def post_json(self, path: str, body: Any) -> tuple[int, Any]: ...


def _is_200(status: int) -> bool:
    return status == 200


def _is_2xx(status: int) -> bool:
    return 200 <= status < 300


async def _post(
    client: JsonClient, what: str, path: str, body: Any, ok: Callable[[int], bool] = _is_200
) -> tuple[int, Any] | Refusal:
    """The answer, or a refusal: none came (status 0), or its status is not ``ok``."""
    try:
        status, data = await client.post_json(path, body)
    except DecoderError as exc:
        return Refusal.unanswered(what, exc)
    return (status, data) if ok(status) else Refusal(f"{what} answered {status}", status, data)


async def restore(client: JsonClient, slot: int, filename: str, n_tokens: int, *, more: bool = False) -> Refusal | None:
    """``POST /slots/S?action=restore`` of ``filename`` (in the server's ``--slot-save-path``): None
    when the slot now holds ``n_tokens`` tokens (``more``: at least that many), else why not.  A
    refused restore may have left cells in the slot: the caller erases it."""
    answer = await _post(client, "restore", f"/slots/{slot}?action=restore", {"filename": filename})
    if isinstance(answer, Refusal):
        return answer
    status, data = answer
    n_restored = data.get("n_restored") if isinstance(data, dict) else None
    if isinstance(n_restored, int) and (n_restored >= n_tokens if more else n_restored == n_tokens):
        return None
    return Refusal(f"restored {n_restored} of {n_tokens} tokens", status, data)


async def save(client: JsonClient, slot: int, filename: str) -> Saved | Refusal:
    """``POST /slots/S?action=save`` into ``filename`` (in the server's ``--slot-save-path``)."""
    answer = await _post(client, "save", f"/slots/{slot}?action=save", {"filename": filename})
    if isinstance(answer, Refusal):
        return answer
    _, data = answer
    n_saved = data.get("n_saved") if isinstance(data, dict) else None
    return Saved(n_saved if isinstance(n_saved, int) else None)


async def erase(client: JsonClient, slot: int, *, tries: int = 1) -> Refusal | None:
    """``POST /slots/S?action=erase``: the slot holds nothing.  Erasing is idempotent, so one that got
    no answer (a connection the decoder closed under it) is sent again, up to ``tries`` in all."""
    for attempt in range(1, tries + 1):
        answer = await _post(client, "erase", f"/slots/{slot}?action=erase", {})
        if not isinstance(answer, Refusal):
            return None
        if answer.status != 0 or attempt == tries:
            return answer
    raise ValueError(f"tries must be at least 1, got {tries}")


async def share(client: JsonClient, slot: int, socket: Path, n_tokens: int) -> str | Refusal:
    """``POST /slots/S?action=share``: the decoder connects to ``socket`` and sends the region of the
    slot's first ``n_tokens`` cells; the answer's ``share_id`` names the share."""
    body = {"socket": str(socket), "n_tokens": n_tokens}
    answer = await _post(client, "share", f"/slots/{slot}?action=share", body, _is_2xx)
    if isinstance(answer, Refusal):
        return answer
    status, data = answer
    share_id = data.get("share_id") if isinstance(data, dict) else None
    if not isinstance(share_id, str):
        return Refusal(f"share answered {status} without a share_id", status, data)
    return share_id


async def adopt(client: JsonClient, slot: int, share_id: str, tokens: list[int]) -> Refusal | None:
    """``POST /slots/S?action=adopt``: the slot takes the shared region's cells as ``tokens``'."""
    answer = await _post(
        client,
        "adopt",
        f"/slots/{slot}?action=adopt",
        # The tokens: the decoder's slot must know what its adopted cells hold, so that the
        # request's common prefix leaves only the last token to evaluate.
        {"share_id": share_id, "n_tokens": len(tokens), "tokens": tokens},
        _is_2xx,
    )
    return answer if isinstance(answer, Refusal) else None


async def prefill(client: JsonClient, slot: int, tokens: tuple[int, ...] | list[int]) -> Evaluated | Refusal:
    """``POST /completion`` of ``tokens`` into ``slot`` with nothing generated: its KV, cached."""
    answer = await _post(
        client,
        "prefill",
        "/completion",
        {"prompt": list(tokens), "n_predict": 0, "id_slot": slot, "cache_prompt": True},
    )
    if isinstance(answer, Refusal):
        return answer
    _, data = answer
    timings = data.get("timings") if isinstance(data, dict) else None
    prompt_ms = timings.get("prompt_ms") if isinstance(timings, dict) else None
    prompt_n = timings.get("prompt_n") if isinstance(timings, dict) else None
    return Evaluated(
        prompt_n if isinstance(prompt_n, int) else None,
        float(prompt_ms) if isinstance(prompt_ms, int | float) else None,
    )


async def next_token(
    client: JsonClient, slot: int, tokens: list[int], *, n_probs: int, cache: bool
) -> NextToken | Refusal:
    """``POST /completion`` of ``tokens`` into ``slot`` for one greedy token with its top ``n_probs``
    probabilities (the pre-sampling softmax); ``cache``: over what the slot already holds (else the
    whole prompt prefilled again)."""
    body = {
        "prompt": tokens,
        "n_predict": 1,
        "n_probs": n_probs,
        "temperature": 0,
        "id_slot": slot,
        "cache_prompt": cache,
    }
    answer = await _post(client, "next token", "/completion", body)
    if isinstance(answer, Refusal):
        return answer
    _, data = answer
    timings = data.get("timings") if isinstance(data, dict) else None
    prompt_n = timings.get("prompt_n") if isinstance(timings, dict) else None
    prompt_ms = timings.get("prompt_ms") if isinstance(timings, dict) else None
    return NextToken(
        data,
        prompt_n if isinstance(prompt_n, int) else None,
        float(prompt_ms) if isinstance(prompt_ms, int | float) and not isinstance(prompt_ms, bool) else None,
    )


def slot_processing(reply_status: int, slots: Any, slot: int) -> bool:
    """Whether the decoder's ``GET /slots`` answer says ``slot`` is still processing a task."""
    if reply_status != 200 or not isinstance(slots, list):
        return False
    return any(isinstance(s, dict) and s.get("id") == slot and s.get("is_processing") is True for s in slots)


async def slot_busy(client: DecoderClient, slot: int) -> bool:
    """``GET /slots``: whether llama-server is still working on ``slot``.  Raises DecoderError."""
    reply = await client.request("GET", "/slots")
    return slot_processing(reply.status, reply.json(), slot)


# A request that leaves its slot unfinished keeps it until the decoder says the slot is idle, for at
# most this long: llama-server finishes a prefill it has begun before it notices the hang-up, which on
# a small loaded CPU is a minute or more for a full slot (docs/reliability.md; the figures are in
# docs/benchmarks.md, "Figures the code cites").  Polled this often: the decoder's state is another process's.
SETTLE_TIMEOUT_S = 120.0
SETTLE_POLL_S = 0.05


async def wait_slot_idle(client: DecoderClient, slot: int, *, running: Callable[[], bool]) -> bool:
    """Poll ``GET /slots`` until llama-server is no longer working on ``slot``: after a request left
    the slot unfinished (its client hung up, or something failed), llama-server may still be
    prefilling it.  Shielded from the cancellation that brought the caller here, bounded by
    ``SETTLE_TIMEOUT_S``, and over as soon as ``running()`` is false (a new decoder's slots are idle)
    or the decoder gives no answer.  False: the slot was still busy at the deadline."""
    with trio.CancelScope(shield=True, deadline=trio.current_time() + SETTLE_TIMEOUT_S) as scope:
        while running():
            try:
                busy = await slot_busy(client, slot)
            except DecoderError:
                return True
            if not busy:
                return True
            await trio.sleep(SETTLE_POLL_S)  # another process's state: polled
    return not scope.cancelled_caught


def is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


async def apply_template(client: JsonClient, body: dict[str, Any]) -> str:
    """``POST /apply-template``: a chat request's prompt, templated as its chat endpoint would.
    Raises DecoderError."""
    status, data = await client.post_json("/apply-template", body)
    if status != 200 or not isinstance(data, dict) or not isinstance(data.get("prompt"), str):
        raise DecoderProtocolError(f"/apply-template answered {status}", upstream_status=status)
    return str(data["prompt"])


async def tokenize(client: JsonClient, prompt: Any) -> list[int]:
    """``POST /tokenize`` with the special-token flags llama-server's completion path uses.  Raises
    DecoderError."""
    status, data = await client.post_json("/tokenize", {"content": prompt, "add_special": True, "parse_special": True})
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if status != 200 or not is_token_list(tokens):
        raise DecoderProtocolError(f"/tokenize answered {status}", upstream_status=status)
    assert isinstance(tokens, list)
    return tokens


async def delete_stream(client: DecoderClient, conversation: str) -> Reply:
    """``DELETE /v1/stream``: the conversation's stream session stopped, as a client's DELETE stops
    it.  Raises DecoderError."""
    return await client.request("DELETE", f"/v1/stream?conv_id={quote(conversation, safe='')}")


async def decoder_metrics(client: DecoderClient) -> Reply:
    """``GET /metrics``: the decoder's own metrics (llama-server's ``llamacpp:*``, from its
    ``--metrics``).  Raises DecoderError."""
    return await client.request("GET", "/metrics")


async def context(client: DecoderClient) -> SlotContext | None:
    """``GET /props`` and ``GET /v1/models``: the context each slot really got.  None when the
    decoder does not say; raises DecoderError when it does not answer."""
    props = await client.request("GET", "/props")
    models = await client.request("GET", "/v1/models")
    if props.status != 200:
        return None
    return slot_context(props.json(), models.json() if models.status == 200 else None)
