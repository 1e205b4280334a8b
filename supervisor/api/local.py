"""What onebitd answers itself: ``/health`` (and Vertex AI's health route), ``/metrics`` with the
decoder's own metrics appended, ``/metrics/decoder``, the model list of several models, and
``/slots`` refused while ``server.slots_endpoint`` is off, in llama-server's words."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from ..config import ServerConfig
from ..errors import ClientError, DecoderError
from ..http.respond import Responder
from ..llama import decoder as decoder_api
from ..providers import ProviderStatistics
from ..routes.relay import relay_reply
from ..supervise.child import ChildState
from .endpoints import Endpoint, Local
from .serving import Router

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# A scrape waits this long for the decoder's own metrics, then goes without them.
DECODER_METRICS_TIMEOUT_S = 2.0


@attrs.frozen
class ProviderReadiness:
    """What ``/health`` needs of the providers: whether every one's first start is over (healthy,
    or failed), the names of those not ready now, and why a provider was refused at start (or,
    engine "auto", why its OpenVINO engine was), by name."""

    settled: bool = True
    not_ready: tuple[str, ...] = ()
    refused: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, settled: bool, providers: Sequence[ProviderStatistics]) -> ProviderReadiness:
        """From the providers' statistics (``settled``: every first start is over)."""
        return cls(
            settled=settled,
            not_ready=tuple(p.name for p in providers if not p.ready),
            refused=tuple((p.name, why) for p in providers if (why := p.refused or p.fell_back)),
        )


def health(
    state: ChildState,
    providers: ProviderReadiness,
    *,
    draining: bool,
    stopping: bool,
    unrestorable: dict[str, str] | None = None,
    share_refused: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    """``/health``'s status and body: ``ok`` once the decoder is ready and every provider's first
    start is over (the first requests must not quietly take the plain route because a provider is
    still loading); the providers not ready are named, those refused at start with why
    (``providers_refused``), and the models whose restores spare no prompt (``restores_unusable``:
    their hybrid routes and prefix store are off), and those whose decoder refused the share route
    (``share_refused``: why, and their memory's layout)."""
    if draining:
        return 503, {"status": "draining"}
    named: dict[str, Any] = {"providers_not_ready": list(providers.not_ready)} if providers.not_ready else {}
    if providers.refused:
        named["providers_refused"] = dict(providers.refused)
    if unrestorable:
        named["restores_unusable"] = unrestorable
    if share_refused:
        named["share_refused"] = share_refused
    if state is ChildState.READY and providers.settled:
        return 200, {"status": "ok", **named}
    if state is ChildState.FAILED:
        return 503, {"status": "failed"}
    if state in (ChildState.STOPPING, ChildState.STOPPED) and stopping:
        return 503, {"status": "stopping"}
    return 503, {"status": "loading", **named}


@attrs.define
class Answers:
    """The local answers of one front: its models, its providers' readiness and onebitd's metrics."""

    router: Router
    providers: Callable[[], ProviderReadiness]
    metrics: Callable[[], bytes] | None
    live: Callable[[], ServerConfig]

    def health(self, *, draining: bool, stopping: bool) -> tuple[int, dict[str, Any]]:
        return health(
            self.router.health_state(),
            self.providers(),
            draining=draining,
            stopping=stopping,
            unrestorable=self.router.unrestorable(),
            share_refused=self.router.share_refused(),
        )

    async def answer(self, endpoint: Endpoint, out: Responder, *, draining: bool, stopping: bool) -> None:
        """The answer of a ``LOCAL`` endpoint."""
        if endpoint.local is Local.HEALTH:
            status, body = self.health(draining=draining, stopping=stopping)
            retry = [("Retry-After", str(self.live().retry_after_s))] if status != 200 else []
            await out.json(status, body, retry)
        elif endpoint.local is Local.DECODER_METRICS:
            async with self.router.use(None, any_loaded=True) as served:
                served.completions.check_ready()
                reply = await decoder_api.decoder_metrics(served.client)
            await relay_reply(out, reply.status, reply.headers, reply.body)
        elif self.metrics is None:
            raise ClientError(404, "not_found", "no such endpoint: /metrics")
        else:
            await out.whole(200, self.metrics() + await self.decoder_metrics(), METRICS_CONTENT_TYPE)

    async def decoder_metrics(self) -> bytes:
        """The decoder's own metrics (llama-server's ``llamacpp:*`` names, from its ``--metrics``),
        appended to onebitd's, so that one scrape has both; nothing while it is not ready."""
        default = self.router.default
        if default.decoder.state is not ChildState.READY:
            return b""
        with trio.move_on_after(DECODER_METRICS_TIMEOUT_S):
            try:
                reply = await decoder_api.decoder_metrics(default.client)
            except DecoderError:
                return b""
            if reply.status == 200:
                return reply.body if reply.body.endswith(b"\n") or not reply.body else reply.body + b"\n"
        return b""

    async def listed(self, endpoint: Endpoint, out: Responder) -> bool:
        """The model list, with several models: every model, with its state; whether it was."""
        if not (endpoint.listing and self.router.several):
            return False
        await out.json(200, self.router.listing())
        return True

    async def slots_off(self, endpoint: Endpoint, out: Responder) -> bool:
        """``/slots`` while server.slots_endpoint is off: llama-server's --no-slots answer, in its
        words and shape; whether it was."""
        if not endpoint.gated or self.live().slots_endpoint:
            return False
        await out.llama_error(
            501,
            "not_supported_error",
            "This server does not support slots endpoint: /slots shows every client's prompt; "
            "set server.slots_endpoint = true in onebit.toml to serve it (llama-server's --slots)",
        )
        return True
