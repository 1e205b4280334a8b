"""Vertex AI's prediction route, as llama-server serves it (build 11434, tools/server/server-http.cpp
``register_gcp_compat``): Google Cloud's custom-container contract.

With ``AIP_MODE=PREDICTION`` in onebitd's environment (Vertex AI sets it in the container), ``POST
AIP_PREDICT_ROUTE`` (default ``/predict``) takes ``{"instances": [...]}``, at most 128, each a request
to one of the API's endpoints named by its ``"@requestFormat"``: a path (``"/v1/chat/completions"``)
or its camel-case alias (``"chatCompletions"``: the path less ``/v1`` and the leading slash, each
``/``, ``-`` or ``_`` dropped and the next letter capitalised).  The answer is ``{"predictions":
[...]}``, each the endpoint's JSON answer (errors included) in order; ``"stream"`` is forced off.
``AIP_HEALTH_ROUTE``, when set, answers as ``/health`` does.  Without ``AIP_MODE`` these paths are
404, as llama-server answers them.

This module is pure: the settings, the alias of a path, and the checks of a body and of an
instance, with llama-server's words.  The front runs each instance through onebitd's own table
(supervisor/api/endpoints.py): a completion is routed like any (a slot, a route line), a refused
endpoint is refused, and llama-server's own ``/predict`` (which would reach the slot actions) is
never asked.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

MAX_INSTANCES = 128  # llama-server's MAX_INSTANCES
FORMAT = "@requestFormat"


class Refused(Exception):
    """A body llama-server answers 400 (``invalid_request_error``), in its words."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@attrs.frozen
class Vertex:
    predict: str = "/predict"
    health: str = ""  # empty: no extra health route (Vertex then asks the container's /health)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Vertex | None:
        """The routes Vertex AI's variables ask for, or None when ``AIP_MODE`` is not ``PREDICTION``."""
        if environ.get("AIP_MODE", "") != "PREDICTION":
            return None
        return cls(
            predict=_route(environ.get("AIP_PREDICT_ROUTE", "")) or "/predict",
            health=_route(environ.get("AIP_HEALTH_ROUTE", "")),
        )


def _route(value: str) -> str:
    return value if not value or value.startswith("/") else "/" + value


def alias(path: str) -> str:
    """llama-server's ``path_to_gcp_format``: ``/v1/chat/completions`` is ``chatCompletions``."""
    text = path[3:] if len(path) > 3 and path.startswith("/v1") else path
    text = text.removeprefix("/")
    out: list[str] = []
    cap = False
    for c in text:
        if c == ":":
            break
        if c in "/-_":
            cap = True
        else:
            out.append(c.upper() if cap else c)
            cap = False
    return "".join(out)


def aliases(paths: Iterable[str]) -> dict[str, str]:
    """Alias to path; on a collision the first path wins (llama-server's order is its hash map's)."""
    found: dict[str, str] = {}
    for path in paths:
        found.setdefault(alias(path), path)
    return found


def instances_of(body: dict[str, Any]) -> list[Any]:
    instances = body.get("instances")
    if not isinstance(instances, list):
        raise Refused("request body must include an array field named instances")
    if len(instances) > MAX_INSTANCES:
        raise Refused(f"instances array exceeds maximum size of {MAX_INSTANCES}")
    return instances


def error(message: str, *, code: int = 400, type_: str = "invalid_request_error") -> dict[str, Any]:
    """A prediction that failed, as llama-server writes one."""
    return {"error": {"code": code, "message": message, "type": type_}}


def resolve(instance: Any, known: Mapping[str, str], paths: Iterable[str]) -> tuple[str, dict[str, Any]]:
    """The path an instance asks for and the body to send it (``stream`` off); :class:`Refused`
    with llama-server's words when it names none."""
    if not isinstance(instance, dict):
        raise Refused("each instance must be a JSON object")
    wanted = instance.get(FORMAT)
    if not isinstance(wanted, str):
        raise Refused(f"each instance must include a string {FORMAT}")
    payload = {key: value for key, value in instance.items() if key != FORMAT}
    if "stream" in payload:
        payload["stream"] = False
    if wanted in known:
        return known[wanted], payload
    if wanted in set(paths):
        return wanted, payload
    raise Refused(f"no handler registered for {FORMAT}: {wanted}")
