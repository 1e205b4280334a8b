"""Vertex AI's prediction route through ``Front``, in process, against tests/fakes/llama/inprocess.py: each
instance through onebitd's table, answered together as llama-server's ``register_gcp_compat`` does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from supervisor.api.front import Front
from supervisor.api.serving import One
from supervisor.api.vertex import Vertex, alias
from supervisor.config import HybridConfig, ServerConfig
from supervisor.llama.slots import SlotPool
from supervisor.routeline import RouteLine
from supervisor.routes.completion import Completions
from tests.fakes.llama.inprocess import FakeLlama
from tests.rigs import asgi
from tests.rigs.asgi import ReadyDecoder, Reply

TIMEOUT = 10
KEY = {"authorization": "Bearer k"}
CHAT = {"messages": [{"role": "user", "content": "one two three"}], "max_tokens": 2}


VERTEX = Vertex(health="/ping")


class Rig:
    def __init__(self, tmp_path: Path, vertex: Vertex | None = VERTEX) -> None:
        self.fake = FakeLlama(tmp_path)
        client = self.fake.client()
        decoder = ReadyDecoder()
        self.slots = SlotPool(2, 8)
        completions = Completions(
            decoder=decoder, client=client, slots=self.slots, settings=HybridConfig(enabled=False)
        )
        self.lines: list[RouteLine] = []
        self.front = Front(
            ServerConfig(api_keys=("k",)),
            One(completions, client, decoder),
            emit=self.lines.append,
            vertex=vertex,
        )

    async def predict(self, body: Any, headers: dict[str, str] | None = None) -> Reply:
        with trio.fail_after(TIMEOUT):
            return await asgi.call(self.front, "POST", "/predict", body, KEY if headers is None else headers)


def test_the_routes_come_from_vertex_ais_variables_as_llama_server_reads_them() -> None:
    assert Vertex.from_environ({}) is None
    assert Vertex.from_environ({"AIP_MODE": "TRAINING"}) is None
    assert Vertex.from_environ({"AIP_MODE": "PREDICTION"}) == Vertex("/predict", "")
    given = {"AIP_MODE": "PREDICTION", "AIP_PREDICT_ROUTE": "v1/go", "AIP_HEALTH_ROUTE": "/alive"}
    assert Vertex.from_environ(given) == Vertex("/v1/go", "/alive")


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/v1/chat/completions", "chatCompletions"),
        ("/chat/completions", "chatCompletions"),
        ("/apply-template", "applyTemplate"),
        ("/v1/messages/count_tokens", "messagesCountTokens"),
        ("/slots/:id_slot", "slots"),
    ],
)
def test_an_endpoint_is_named_by_llama_servers_camel_case_alias(path: str, name: str) -> None:
    assert alias(path) == name


async def test_every_instance_is_answered_in_order_a_completion_routed_on_a_slot(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    instances = [
        {"@requestFormat": "chatCompletions", **CHAT, "stream": True},  # stream is forced off
        {"@requestFormat": "/tokenize", "content": "a b"},
        {"@requestFormat": "props"},  # POST /props: refused, as onebitd refuses it
        {"@requestFormat": "slots"},  # GET /slots: off, in llama-server's words
        {"@requestFormat": "nothing"},
        "not an object",
        {"content": "no format"},
        {"@requestFormat": "/v1/stream"},
    ]
    reply = await rig.predict({"instances": instances})
    assert (reply.status, reply.headers["content-type"]) == (200, "application/json")
    chat, tokens, props, slots, nothing, bad, formatless, stream = reply.json()["predictions"]
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["content"] == "one two"
    assert tokens == {"tokens": FakeLlama.tokenize("a b")}
    assert (props["error"]["code"], props["error"]["type"]) == (501, "not_supported_error")
    assert slots["error"]["code"] == 501
    assert nothing["error"]["message"] == "no handler registered for @requestFormat: nothing"
    assert bad["error"]["message"] == "each instance must be a JSON object"
    assert formatless["error"]["message"] == "each instance must include a string @requestFormat"
    assert stream["error"]["message"] == "predict route does not support streaming responses"
    [line] = rig.lines  # the completion's, on a slot of onebitd's
    assert (line.endpoint, line.outcome, line.slot) == ("/v1/chat/completions", "ok", 0)
    [(_, _, forwarded)] = [seen for seen in rig.fake.seen if seen[0] == "/v1/chat/completions"]
    assert forwarded["stream"] is False
    assert "/predict" not in [seen[0] for seen in rig.fake.seen]  # llama-server's own is never asked
    assert rig.slots.statistics().busy == 0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "request body must include an array field named instances"),
        ({"instances": {}}, "request body must include an array field named instances"),
        ({"instances": [{}] * 129}, "instances array exceeds maximum size of 128"),
    ],
)
async def test_a_body_llama_server_refuses_is_refused_in_its_shape(tmp_path: Path, body: Any, message: str) -> None:
    reply = await Rig(tmp_path).predict(body)
    assert reply.status == 400
    assert reply.json() == {"error": {"code": 400, "message": message, "type": "invalid_request_error"}}


async def test_the_key_applies_and_the_health_route_is_public(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    assert (await rig.predict({"instances": []}, {})).status == 401
    with trio.fail_after(TIMEOUT):
        health = await asgi.call(rig.front, "GET", "/ping")
    assert (health.status, health.json()) == (200, {"status": "ok"})


async def test_without_aip_mode_the_routes_are_not_there_as_in_llama_server(tmp_path: Path) -> None:
    rig = Rig(tmp_path, vertex=None)
    assert (await rig.predict({"instances": []})).status == 404
