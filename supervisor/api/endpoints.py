"""llama-server's HTTP API as onebitd serves it: for every path a client may use, who answers it.

The paths are llama-server's own route table (tools/server/server.cpp of build 11434), so a client
written for llama-server finds every endpoint it knows at the same path, by every spelling:

- ``COMPLETION``: the completion endpoints, routed (a slot of onebitd's, maybe a hybrid route), the
  Anthropic and Responses APIs among them (read in the chat form llama-server converts them into);
- ``SLOT``: the model runs on a slot (embeddings, rerank, infill): relayed on the plain route with a
  slot of its own, so onebitd's slot count stays the decoder's;
- ``RELAY``: relayed as is (no slot: tokenizing, token counts, the model list, ``/props``, the
  resumable streams' replay, lookup and stop, ``/cors-proxy``);
- ``LOCAL``: answered by onebitd itself (``/health``, ``/metrics``): which answer, :class:`Local`;
- ``REFUSED``: what would change the decoder's settings or slots, which onebitd owns;
- ``PREDICT``: Vertex AI's prediction route, served by onebitd when its environment asks for it
  (supervisor/api/vertex.py), each instance dispatched through this table.

A path not here is answered 404; a known path asked with another method, 405.  ``UNSERVED`` names
the routes of llama-server's table that onebitd does not serve, and why.  What the front does with a
path beyond its kind is an endpoint's field too (``public``: no API key asked; ``listing``: onebitd's
own model list; ``gated``: only with ``server.slots_endpoint``), so the front compares no path itself.
The status page's paths are :data:`PAGE` and those below it (:func:`page_name`).
"""

from __future__ import annotations

import enum

import attrs

from ..routes.prompt import CHAT
from .vertex import Vertex


class Kind(enum.Enum):
    COMPLETION = "completion"
    SLOT = "slot"
    RELAY = "relay"
    LOCAL = "local"
    REFUSED = "refused"
    PREDICT = "predict"  # Vertex AI's route (supervisor/api/vertex.py): each instance through this table


class Local(enum.Enum):
    """What onebitd answers itself at a ``LOCAL`` endpoint."""

    HEALTH = "health"  # whether onebitd is ready (supervisor/api/local.py's health)
    METRICS = "metrics"  # onebitd's metrics, the decoder's own appended
    DECODER_METRICS = "decoder_metrics"  # the decoder's own metrics, relayed


@attrs.frozen
class Endpoint:
    kind: Kind
    # The path asked of the decoder, and the endpoint the handoff logic knows it by: every spelling
    # of one llama-server handler maps to one path (``/chat/completions`` is ``/v1/chat/completions``).
    canonical: str = ""
    # SLOT: llama-server honours ``id_slot`` here.  Embeddings and rerank tasks take no ``id_slot``:
    # those run on a slot llama-server picks.  (A stock llama-server's Anthropic conversion drops it
    # too; patches/llama-server-agent.patch keeps it, so /v1/messages is pinned like chat.)
    pinned: bool = True
    # REFUSED: why, in the answer's words.
    why: str = ""
    # RELAY: the answer is relayed chunk by chunk as it comes (a stream's replay), not whole.
    streamed: bool = False
    # LOCAL: which answer.
    local: Local | None = None
    # Answered without an API key, as llama-server answers /health (and onebitd its /metrics).
    public: bool = False
    # RELAY: with several models, onebitd answers with every model and its state (the model list).
    listing: bool = False
    # RELAY: served only with server.slots_endpoint (it shows every client's prompt, llama-server's --slots).
    gated: bool = False
    # SLOT: the model runs for a prompt (infill), not for a vector or a score (embeddings, rerank):
    # a request a hybrid route could in principle prefill, so the plain route says why not.
    generates: bool = True
    # RELAY: llama-server's web UI's MCP proxy, which forwards the client's
    # ``x-llama-server-proxy-header-<name>`` headers to its target as ``<name>``: those go on to the
    # decoder (supervisor/api/relayed.py's proxy_headers), and no other header of the client's.
    proxied: bool = False

    @property
    def routed(self) -> bool:
        """A request that takes a slot: it is queued, counted in flight and gets a route line."""
        return self.kind in (Kind.COMPLETION, Kind.SLOT)


def _completion(canonical: str) -> Endpoint:
    return Endpoint(Kind.COMPLETION, canonical)


def _slot(canonical: str) -> Endpoint:
    return Endpoint(Kind.SLOT, canonical)


def _embedding(canonical: str) -> Endpoint:
    """Embeddings and rerank: their tasks take no ``id_slot``, and no prompt to hand over."""
    return Endpoint(Kind.SLOT, canonical, pinned=False, generates=False)


def local_endpoint(answer: Local) -> Endpoint:
    """An endpoint onebitd answers itself, without an API key."""
    return Endpoint(Kind.LOCAL, local=answer, public=True)


_RELAY = Endpoint(Kind.RELAY)
_REPLAY = Endpoint(Kind.RELAY, streamed=True)
_LISTING = Endpoint(Kind.RELAY, listing=True)
_PROXY = Endpoint(Kind.RELAY, proxied=True)
_SETTINGS = Endpoint(
    Kind.REFUSED,
    why="onebitd owns the decoder's settings: change them in onebit.toml (decoder.extra_args) and restart onebitd",
)
_SLOT_ACTIONS = Endpoint(
    Kind.REFUSED,
    why="onebitd owns the decoder's slots (it saves, restores and erases them for its routes); "
    "slot actions are not taken from clients",
)

# path -> method -> endpoint.  HEAD is allowed wherever GET is.
ROUTES: dict[str, dict[str, Endpoint]] = {
    "/health": {"GET": local_endpoint(Local.HEALTH)},
    "/v1/health": {"GET": local_endpoint(Local.HEALTH)},
    "/metrics": {"GET": local_endpoint(Local.METRICS)},
    "/metrics/decoder": {"GET": local_endpoint(Local.DECODER_METRICS)},
    "/v1/chat/completions": {"POST": _completion(CHAT)},
    "/chat/completions": {"POST": _completion(CHAT)},
    "/v1/completions": {"POST": _completion("/v1/completions")},
    # llama-server's /completions is its native endpoint (the handler of /completion), not OpenAI's.
    "/completions": {"POST": _completion("/completion")},
    "/completion": {"POST": _completion("/completion")},
    "/infill": {"POST": _slot("/infill")},
    "/v1/responses": {"POST": _completion("/v1/responses")},
    "/responses": {"POST": _completion("/v1/responses")},
    "/v1/messages": {"POST": _completion("/v1/messages")},
    "/embedding": {"POST": _embedding("/embeddings")},
    "/embeddings": {"POST": _embedding("/embeddings")},
    "/v1/embeddings": {"POST": _embedding("/v1/embeddings")},
    "/rerank": {"POST": _embedding("/rerank")},
    "/reranking": {"POST": _embedding("/rerank")},
    "/v1/rerank": {"POST": _embedding("/rerank")},
    "/v1/reranking": {"POST": _embedding("/rerank")},
    "/tokenize": {"POST": _RELAY},
    "/detokenize": {"POST": _RELAY},
    "/apply-template": {"POST": _RELAY},
    "/chat/completions/input_tokens": {"POST": _RELAY},
    "/v1/chat/completions/input_tokens": {"POST": _RELAY},
    "/responses/input_tokens": {"POST": _RELAY},
    "/v1/responses/input_tokens": {"POST": _RELAY},
    "/v1/messages/count_tokens": {"POST": _RELAY},
    "/v1/chat/completions/control": {"POST": _RELAY},
    "/v1/models": {"GET": _LISTING},
    "/models": {"GET": _LISTING},
    "/props": {"GET": _RELAY, "POST": _SETTINGS},
    "/lora-adapters": {"GET": _RELAY, "POST": _SETTINGS},
    "/slots": {"GET": Endpoint(Kind.RELAY, gated=True)},
    # Resumable streams (llama-server's server-stream.h): the session lives in the decoder, which
    # owns every conversation (the default model's).  ``conv_id`` travels in the query.
    "/v1/stream": {"GET": _REPLAY, "DELETE": _RELAY},
    "/v1/streams/lookup": {"POST": _RELAY},
    # 403 "this feature is disabled" unless the decoder runs with --ui-mcp-proxy (decoder.extra_args).
    "/cors-proxy": {"GET": _PROXY, "POST": _PROXY},
}

# llama-server's routes (method, path) that onebitd does not serve, and why (docs/protocol.md's table
# says the same): 404, or 405 where onebitd serves the path by another method.
_ROUTER = (
    "llama-server's router mode's model management: onebitd's models are its config's ([[model]] tables), "
    "loaded on demand by a request's model, or by onebitctl load MODEL"
)
_AUDIO = "multipart audio needs a speech model onebitd does not run"
_TOOLS = "llama-server's web UI tools and MCP servers; onebitd runs it with --no-webui"
UNSERVED: dict[tuple[str, str], str] = {
    ("POST", "/models"): _ROUTER,
    ("POST", "/models/load"): _ROUTER,
    ("POST", "/models/unload"): _ROUTER,
    ("GET", "/models/sse"): _ROUTER,
    ("DELETE", "/models"): _ROUTER,
    ("POST", "/v1/audio/transcriptions"): _AUDIO,
    ("POST", "/audio/transcriptions"): _AUDIO,
    ("POST", "/v1/systemone"): "a decision model onebitd does not run",
    ("GET", "/tools"): _TOOLS,
    ("POST", "/tools"): _TOOLS,
}


def vertex_endpoints(vertex: Vertex | None) -> dict[str, dict[str, Endpoint]]:
    """Vertex AI's routes, where onebitd's environment asks for them (``AIP_MODE=PREDICTION``)."""
    if vertex is None:
        return {}
    routes = {vertex.predict: {"POST": Endpoint(Kind.PREDICT)}}
    if vertex.health:
        routes[vertex.health] = {"GET": local_endpoint(Local.HEALTH)}
    return routes


def public(methods: dict[str, Endpoint] | None) -> bool:
    """Whether a path with these methods is answered without an API key (by any method: a wrong
    one is told 405, not 401)."""
    return methods is not None and any(endpoint.public for endpoint in methods.values())


def lookup(path: str) -> dict[str, Endpoint] | None:
    """The methods served at ``path``, or None for a path onebitd does not know."""
    if path.startswith("/slots/"):
        return {"POST": _SLOT_ACTIONS}
    return ROUTES.get(path)


# The status page's paths (supervisor/api/statuspage.py answers them): its own files and its data.
PAGE = "/onebit/"


def page_name(path: str) -> str | None:
    """What a status page path asks for under :data:`PAGE` ("" for the page itself, which
    ``/onebit`` is too); None for a path not under it."""
    if path == PAGE.rstrip("/"):
        return ""
    return path.removeprefix(PAGE) if path.startswith(PAGE) else None
