"""Vertex AI's prediction, served: every instance of a body at once, each through onebitd's table
(supervisor/api/endpoints.py) as a request of its own would go (a completion takes a slot and logs
its route line), their answers kept and sent together.  The checks and llama-server's words are
supervisor/api/vertex.py's."""

from __future__ import annotations

import json
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import attrs
import trio

from ..errors import ClientError, DecoderError
from ..http.respond import Receive, Responder
from . import vertex as aip
from .endpoints import ROUTES, Endpoint, Kind


async def _never_gone() -> dict[str, Any]:
    """A prediction instance's ``receive``: the hang-up of the whole request cancels them all."""
    await trio.sleep_forever()
    raise AssertionError("unreachable")


@attrs.define
class Kept:
    """An instance's answer, kept instead of sent: what llama-server puts in its prediction."""

    messages: list[dict[str, Any]] = attrs.Factory(list)

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        await trio.lowlevel.checkpoint()

    def prediction(self) -> Any:
        body = b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")
        if not body:
            return None
        try:
            return json.loads(body)
        except ValueError:
            return body.decode("utf-8", "replace")


class Serves(Protocol):
    """What an instance is served by: the front's own ways to answer one request."""

    async def completion(
        self, path: str, body: dict[str, Any], receive: Receive, out: Responder, endpoint: Endpoint
    ) -> None: ...

    async def local(self, endpoint: Endpoint, out: Responder) -> None: ...

    async def slots_off(self, endpoint: Endpoint, out: Responder) -> bool: ...

    async def pass_through(self, out: Responder, method: str, path: str, body: Any) -> None: ...


class Predict:
    def __init__(self, serves: Serves) -> None:
        self.serves = serves
        self.aliases = aip.aliases(ROUTES)

    async def __call__(self, body: dict[str, Any], out: Responder, cancels: AbstractAsyncContextManager[None]) -> None:
        """Answer ``body``'s instances in the block ``cancels`` (which a hang-up cancels)."""
        try:
            instances = aip.instances_of(body)
        except aip.Refused as exc:
            await out.llama_error(400, "invalid_request_error", exc.message)
            return
        predictions: list[Any] = [None] * len(instances)
        async with cancels, trio.open_nursery() as each:
            for index, instance in enumerate(instances):
                each.start_soon(self._one, index, instance, predictions)
        await out.json(200, {"predictions": predictions})

    async def _one(self, index: int, instance: Any, predictions: list[Any]) -> None:
        try:
            path, payload = aip.resolve(instance, self.aliases, ROUTES)
        except aip.Refused as exc:
            predictions[index] = aip.error(exc.message)
            return
        methods = ROUTES[path]
        method = "POST" if "POST" in methods else "GET"
        kept = Kept()
        try:
            await self._serve(path, method, methods[method], payload, Responder(kept.send, trio.current_time()))
        except aip.Refused as exc:
            predictions[index] = aip.error(exc.message)
        except ClientError as exc:
            predictions[index] = aip.error(exc.message, code=exc.status)
        except DecoderError as exc:
            predictions[index] = aip.error(exc.public, code=exc.status, type_="server_error")
        else:
            predictions[index] = kept.prediction()

    async def _serve(self, path: str, method: str, endpoint: Endpoint, payload: dict[str, Any], sub: Responder) -> None:
        if endpoint.routed:
            await self.serves.completion(path, payload, _never_gone, sub, endpoint)
        elif endpoint.kind is Kind.LOCAL:
            await self.serves.local(endpoint, sub)
        elif endpoint.kind is Kind.REFUSED:
            await sub.llama_error(501, "not_supported_error", endpoint.why)
        elif endpoint.kind is Kind.RELAY and not endpoint.streamed:
            if not await self.serves.slots_off(endpoint, sub):
                await self.serves.pass_through(sub, method, path, payload if method == "POST" else None)
        else:
            raise aip.Refused("predict route does not support streaming responses")
