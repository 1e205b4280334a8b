"""The fake llama-server's endpoints other than the completions and the slot actions.

Endpoints answer with llama-server's JSON shapes (checked against build 11434): ``GET /health``,
``/v1/models``, ``/models``, ``/props``, ``/slots``, ``/lora-adapters``, ``/metrics``; ``POST
/tokenize`` (one token per whitespace-separated word, its id a stable hash), ``/detokenize``,
``/apply-template`` (ChatML), ``/v1/messages/count_tokens``, the completions and the slot actions
(tests/fakes/llama/completion.py, tests/fakes/llama/slots.py); embeddings and rerank 501, as a
decoder started without ``--embeddings``/``--reranking``; ``/cors-proxy`` 403, as one without
``--ui-mcp-proxy``; llama-server's resumable streams (``/v1/stream``, ``/v1/streams/lookup``) as if
one session, ``live``, were being written.  An invalid body gets 400 in llama-server's error shape
``{"error": {"code", "message", "type"}}``; while loading, every endpoint but ``/health`` gets 503.

Extending: an endpoint is a generator function registered with ``@route(method, path)`` (``prefix=True``
to match a path prefix, as ``/slots/<id>`` does); it takes the :class:`Core` and the :class:`Request`,
yields steps and raises :class:`HttpError` for an error reply.
"""

from __future__ import annotations

import time
from typing import Any

from .core import N_VOCAB, Core, chatml, route
from .steps import Answer, Chunk, Head, HttpError, Pause, Request, Whole, reply


@route("GET", "/health")
def health(core: Core, request: Request) -> Answer:
    with core.lock:
        core.health_checks += 1
        checks = core.health_checks
    limit = core.modes().unhealthy_after
    if limit is not None and checks > limit:
        raise HttpError(503, "fake decoder: unhealthy (unhealthy_after)")
    if core.loading():
        raise HttpError(503, "Loading model")
    yield reply(200, {"status": "ok"})


@route("GET", "/v1/models")
@route("GET", "/models")
def models(core: Core, request: Request) -> Answer:
    s = core.settings
    meta: dict[str, Any] = {"n_vocab": N_VOCAB}
    if s.n_ctx is not None:
        meta["n_ctx"] = s.n_ctx * s.n_slots
    model = {"name": s.alias, "model": s.alias, "type": "model", "capabilities": ["completion"]}
    data = {"id": s.alias, "aliases": [s.alias], "tags": [], "object": "model", "created": int(time.time())}
    yield reply(200, {"models": [model], "object": "list", "data": [{**data, "owned_by": "llamacpp", "meta": meta}]})


@route("GET", "/props")
def props(core: Core, request: Request) -> Answer:
    s = core.settings
    found: dict[str, Any] = {"total_slots": s.n_slots, "model_path": s.model, "model_alias": s.alias}
    if s.n_ctx is not None:
        found["default_generation_settings"] = {"n_ctx": s.n_ctx}
    yield reply(200, {**found, "build_info": "fake"})


@route("GET", "/slots")
def slot_list(core: Core, request: Request) -> Answer:
    with core.lock:
        busy = list(core.processing)
    n_ctx = {} if core.settings.n_ctx is None else {"n_ctx": core.settings.n_ctx}
    yield reply(200, [{"id": i, **n_ctx, "speculative": False, "is_processing": n > 0} for i, n in enumerate(busy)])


@route("GET", "/lora-adapters")
def lora_adapters(core: Core, request: Request) -> Answer:
    yield reply(200, [])


@route("GET", "/metrics")
def metrics(core: Core, request: Request) -> Answer:
    text = "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
    text += "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 42\n"
    yield Whole(200, text.encode(), "text/plain; version=0.0.4")


@route("POST", "/embeddings")
@route("POST", "/v1/embeddings")
def embeddings(core: Core, request: Request) -> Answer:
    raise HttpError(501, "This server does not support embeddings. Start it with `--embeddings`")
    yield  # a generator, as every endpoint is


@route("POST", "/rerank")
def rerank(core: Core, request: Request) -> Answer:
    raise HttpError(501, "This server does not support reranking. Start it with `--reranking`")
    yield


@route("GET", "/cors-proxy")
@route("POST", "/cors-proxy")
def cors_proxy(core: Core, request: Request) -> Answer:
    """llama-server without --ui-mcp-proxy (server.cpp's res_403)."""
    yield reply(403, {"error": {"message": "this feature is disabled", "type": "feature_disabled"}})


@route("POST", "/tokenize")
def tokenize_endpoint(core: Core, request: Request) -> Answer:
    body = request.json()
    content = body.get("content", "")
    if isinstance(content, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in content):
        ids = list(content)
    elif isinstance(content, str):
        ids = core.tokenize(content)
    else:
        raise HttpError(400, "'content' must be a string or an array of tokens")
    if body.get("with_pieces") is True:
        yield reply(200, {"tokens": [{"id": i, "piece": core.word(i)} for i in ids]})
        return
    yield reply(200, {"tokens": ids})


@route("POST", "/detokenize")
def detokenize(core: Core, request: Request) -> Answer:
    tokens = request.json().get("tokens", [])
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise HttpError(400, "'tokens' must be an array of integers")
    yield reply(200, {"content": " ".join(core.word(t) for t in tokens)})


@route("POST", "/apply-template")
def apply_template(core: Core, request: Request) -> Answer:
    body = request.json()
    generation_prompt = body.get("add_generation_prompt", True) is not False
    yield reply(200, {"prompt": chatml(body.get("messages"), generation_prompt=generation_prompt)})


@route("POST", "/v1/messages/count_tokens")
def count_tokens(core: Core, request: Request) -> Answer:
    yield reply(200, {"input_tokens": len(chatml(request.json().get("messages")).split())})


# llama-server's resumable streams, as if one session, ``live``, were being written until released.


@route("POST", "/v1/streams/lookup")
def streams_lookup(core: Core, request: Request) -> Answer:
    yield reply(200, [])


@route("DELETE", "/v1/stream")
def stream_stop(core: Core, request: Request) -> Answer:
    yield Whole(204, b"")


@route("GET", "/v1/stream")
def stream_replay(core: Core, request: Request) -> Answer:
    if request.query.get("conv_id") != "live":
        raise HttpError(404, "Stream not found or expired")
    yield Head()
    yield Chunk(b'data: {"n": 1}\n\n')
    yield Pause(lambda: True)
    yield Chunk(b"data: [DONE]\n\n")
