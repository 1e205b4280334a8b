"""The decoder's own reply as the fidelity reference for a handed-over one: asked straight on its
socket, past onebitd, on a slot pinned for it.

A handoff's restore leaves the decoder to evaluate only the prompt's last token; the reference is the
reply the decoder gives when its own prompt cache leaves it the same (a reply prefilled in batches can
differ: llama.cpp's greedy output depends on the batch split).  The real-parts tests hold onebitd's
handed-over replies to it (tests/real/test_real_hybrid.py, tests/real/test_real_agent.py,
tests/real/test_real_tool_templates.py, tests/real/test_real_share.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from supervisor.testing import Running, unix_transport

SLOT = 1  # the reference's slot: onebitd's own requests in these tests are done before it is asked


@asynccontextmanager
async def direct(socket: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A client straight to the decoder listening on ``socket``."""
    async with httpx.AsyncClient(transport=unix_transport(socket), base_url="http://decoder", timeout=120) as client:
        yield client


def direct_to(running: Running) -> AbstractAsyncContextManager[httpx.AsyncClient]:
    """A client straight to the default model's decoder of a running onebitd."""
    return direct(running.daemon.models.default.parts.launcher.socket)


async def fill(
    decoder: httpx.AsyncClient, endpoint: str, body: dict[str, Any], *, answered: bool = True
) -> dict[str, Any]:
    """The reference slot erased, then ``body`` into it, whole (a plain prefill of the whole prompt);
    that reply.  ``answered`` false: its status is not held to 200 (a chat template's parser may
    refuse a reply cut at one token with a 500, and the slot holds the prompt all the same)."""
    erased = await decoder.post(f"/slots/{SLOT}", params={"action": "erase"})
    assert erased.status_code == 200, erased.text
    reply = await decoder.post(endpoint, json={**pinned(body), "stream": False})
    assert reply.status_code == 200 or not answered, reply.text
    data: dict[str, Any] = reply.json()
    return data


def pinned(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` on the reference slot, from its prompt cache."""
    return {**body, "cache_prompt": True, "id_slot": SLOT}


async def cached_reply(
    decoder: httpx.AsyncClient, endpoint: str, body: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The reference: ``body`` filled into the slot, then asked again whole, when the decoder evaluates
    only the prompt's last token, as after a restore.  The filling reply (its timings are a plain
    prefill's) and the cached one."""
    filled = await fill(decoder, endpoint, body)
    reply = await decoder.post(endpoint, json={**pinned(body), "stream": False})
    assert reply.status_code == 200, reply.text
    cached: dict[str, Any] = reply.json()
    if "timings" in cached:  # Anthropic's shape has none
        assert cached["timings"]["prompt_n"] <= 2, cached["timings"]  # it answered from its cache
    return filled, cached
