"""The route line: exactly one structured line per request, the same fields on every route.

    route=plain req=7f3a status=200 outcome=ok fallback=- memory=- prompt_tokens=47 prefill_ms=0 restore_ms=0
    share_ms=0.000 wait_ms=0 first_byte_ms=12.4 total_ms=388.0 decoder_prompt_n=47 decoder_prompt_ms=31.2
    cached_tokens=0 decoded_n=16 decode_ms=340.2 est_plain_ms=235.0 est_hybrid_ms=290.1 slot=0 provider=-
    engine=- device=-

The field set is fixed so that every route fills the same columns; a value that does not apply is
``-`` (logfmt) or ``null`` (JSON).  ``provider``, ``engine`` and ``device`` name the provider a
hybrid route asked to prefill the prompt and what it computes on (``engine=openvino device=NPU``);
with a ``fallback`` of ``provider-failed`` it is the one that failed, and the decoder prefilled.
``origin_host`` names the host whose prefix store entry gave ``restored_tokens``: in a store the hosts
share (``cache.shared_dir``), another host's name says the conversation came from there.
"""

from __future__ import annotations

import enum
import json
import re
from typing import Any

import attrs


class RequestOutcome(enum.StrEnum):
    """How a request ended, as its route line's ``outcome`` says it."""

    OK = "ok"
    CANCELLED = "cancelled"  # the client hung up before the answer was whole
    ERROR = "error"
    # A stream with a conversation id whose client hung up mid-way: the decoder went on into the
    # conversation's session, and onebitd read it to the end (server.detach_timeout_s at most).
    DETACHED = "detached"


@attrs.frozen(kw_only=True)
class RouteLine:
    """A request's line, built whole once it ended (supervisor/routes/story.py, the one builder)
    and rendered then.  Its fields, in this order, are the line's (:data:`FIELDS`)."""

    route: str = "plain"
    req: str
    endpoint: str
    status: int = 0
    outcome: RequestOutcome = RequestOutcome.OK
    fallback: str | None = None
    memory: str | None = None  # with share-refused*: the decoder's memory layout (kv+swa, kv+swa+recurrent)
    prompt_tokens: int | None = None
    prefill_ms: float = 0.0
    restore_ms: float = 0.0
    share_ms: float = 0.0
    wait_ms: float = 0.0  # on shared cores: the handoff's wait for the decoder's prefills in flight
    first_byte_ms: float | None = None
    total_ms: float | None = None
    decoder_prompt_n: int | None = None
    decoder_prompt_ms: float | None = None
    provider_prompt_n: int | None = None  # prompt tokens the provider evaluated (its own cache held the rest)
    restored_tokens: int | None = None  # prompt tokens restored from the prefix store into the slot
    origin_host: str | None = None  # the server.host_id that stored the restored entry (a shared store: maybe another)
    cached_tokens: int | None = None  # prompt tokens the decoder reused from its cache (timings.cache_n)
    decoded_n: int | None = None  # tokens the decoder generated, and its time for them (timings.predicted_*)
    decode_ms: float | None = None
    est_plain_ms: float | None = None  # the cost decision's estimates, when it ran
    est_hybrid_ms: float | None = None
    slot: int | None = None
    provider: str | None = None  # the provider asked to prefill, and what it computes on
    engine: str | None = None
    device: str | None = None
    model: str | None = None  # the model that served it (a name of [[model]], or the one model's)
    load_ms: float | None = None  # how long it waited for its model to load (several models only)
    error: str | None = None

    def fields(self) -> dict[str, Any]:
        # getattr, not attrs.asdict: every field is a scalar, and asdict's deep copy is slower.
        return {name: getattr(self, name) for name in FIELDS}

    def logfmt(self) -> str:
        # One loop with no call for the common values (None, a float, an int): it runs once a
        # request, over every field.  An outcome is a str: written as its value.
        out: list[str] = []
        for name in FIELDS:
            value = getattr(self, name)
            if value is None:
                out.append(_DASH[name])
            elif name == "share_ms":
                out.append(f"{name}={value:.3f}")
            elif isinstance(value, float):
                out.append(f"{name}={value:.1f}" if value else _ZERO[name])
            elif value.__class__ is int:
                out.append(f"{name}={value}")
            else:
                text = str(value)
                out.append(f"{name}={text}" if _PLAIN(text) else f"{name}={json.dumps(text)}")
        return " ".join(out)

    def json(self) -> str:
        return json.dumps(self.fields(), separators=(",", ":"))


FIELDS = tuple(a.name for a in attrs.fields(RouteLine))
# A value written as it is: not empty, and no space, quote, equals sign, backslash or control character.
_PLAIN = re.compile(r'[^\x00-\x20"=\\]+').fullmatch
# A field without a value, and a float field of 0, as logfmt writes them.
_DASH = {name: f"{name}=-" for name in FIELDS}
_ZERO = {name: f"{name}=0" for name in FIELDS}
