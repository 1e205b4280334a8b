"""The walking skeleton against the real llama-server: one request through onebitd."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio

from tests.rigs.rig import make_config, real_llama_server, run_daemon


async def test_a_chat_completion_goes_through_onebitd_to_the_real_decoder(short_dir: Path) -> None:
    real_llama_server()
    config = make_config(short_dir, model={"parallel": 2, "ctx_size": 1024})
    with trio.fail_after(120):
        async with run_daemon(config) as running, httpx.AsyncClient(base_url=running.url, timeout=120) as client:
            reply = await client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0},
            )
            assert reply.status_code == 200
            assert reply.json()["choices"][0]["message"]["content"]
