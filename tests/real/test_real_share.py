"""The share route against the real parts: the patched llama-server lends a slot's KV cache,
supervisor.llama.share_worker writes a stock llama-server's rows into it, SmolLM2.  The reply must be
what the decoder answers from its own prompt cache for the same tokens (as the file route's:
tests/real/test_real_hybrid.py), with one prompt token left for the decoder; every way the share can fail
takes the fallback docs/protocol.md gives, and its reply is then a plain prefill's."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from supervisor.config import Config, locate
from supervisor.llama.llama_server import model_args
from supervisor.supervise.child import ChildState
from supervisor.testing import unix_transport
from tests.real.test_real_hybrid import QUESTION, ask, body_for, plain_reply, reference_reply
from tests.rigs.rig import HANDOFF_ALWAYS, TESTS, RouteLines, child_of, make_config, real_llama_server, run_daemon

pytestmark = pytest.mark.real

ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/completion"]


def share_config(runtime: Path, *, fault: str = "", decoder_args: tuple[str, ...] = ()) -> Config:
    """The share route on, with supervisor.llama.share_worker (or tests/fakes/share_meddler.py) as its provider."""
    base = make_config(runtime, model={"parallel": 4, "ctx_size": 2048})
    model = locate.model_path(base.model.path)
    assert model is not None
    server_args = [str(real_llama_server()), *model_args(base.model, model), *decoder_args, "-t", "1"]
    if fault:
        command = [
            sys.executable,
            str(TESTS / "fakes" / "share_meddler.py"),
            fault,
            str(runtime / "decoder.sock"),
            *server_args,
        ]
    else:
        command = [sys.executable, "-m", "supervisor.llama.share_worker", *server_args]
    return make_config(
        runtime,
        model={"parallel": 4, "ctx_size": 2048},
        decoder={"threads": 1, "extra_args": list(decoder_args)},
        hybrid={"enabled": True, "min_prompt_tokens": 16, "mode": "share", **HANDOFF_ALWAYS},
        # The decoder's own build, whose state is exact: admitted unmeasured (the meddlers' faults are
        # for the requests, not for the start-time check).
        provider=[{"kind": "worker", "name": "share", "command": command, "fidelity_check": False}],
    )


async def test_the_share_route_gives_the_decoders_cached_greedy_reply_on_every_endpoint_streamed_and_whole(
    short_dir: Path, route_lines: RouteLines, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ONEBIT_KV_SHARE", raising=False)
    cases = [(endpoint, stream) for endpoint in ENDPOINTS for stream in (False, True)]
    with trio.fail_after(300):
        async with run_daemon(share_config(short_dir)) as running:
            worker = running.daemon.models.default.parts.providers.all[0]
            await child_of(worker).wait_state(ChildState.READY)
            expected = [
                await reference_reply(
                    running.daemon.models.default.parts.launcher.socket, endpoint, body_for(endpoint, False)
                )
                for endpoint, _ in cases
            ]
            async with httpx.AsyncClient(base_url=running.url, timeout=120) as client:
                got = [await ask(client, endpoint, body_for(endpoint, stream)) for endpoint, stream in cases]
    assert got == [text for text, _ in expected]
    assert len(route_lines.lines) == len(cases)
    for line, (_, plain_timings) in zip(route_lines.lines, expected, strict=True):
        assert (line["route"], line["fallback"], line["outcome"]) == ("share", None, "ok")
        # A plain prefill evaluates every prompt token; the share route handed them all over.
        assert line["decoder_prompt_n"] == 1
        assert line["prompt_tokens"] == plain_timings["prompt_n"] >= 16
        assert line["share_ms"] > 0
    assert list((short_dir / "state").iterdir()) == []
    assert [n for n in os.listdir(short_dir) if n.startswith("share-")] == []


async def test_share_mode_on_the_embedded_default_takes_the_share_route_with_its_llama_server_provider(
    short_dir: Path, route_lines: RouteLines, monkeypatch: pytest.MonkeyPatch
) -> None:
    # config/onebit.toml with hybrid.mode = "share": the llama-server provider prefills, saves and
    # writes the saved rows into the region the decoder lent (supervisor/providers/llama.py).
    monkeypatch.delenv("ONEBIT_KV_SHARE", raising=False)
    shipped = (Path(__file__).parents[2] / "config" / "onebit.toml").read_text()
    config = make_config(
        short_dir,
        # Its provider on the decoder's own engine: the share route's replies are compared exactly.
        text=shipped.replace('mode = "file"', 'mode = "share"').replace('engine = "auto"', 'engine = "ggml"'),
        model={"parallel": 2, "ctx_size": 2048},
        decoder={"threads": 1},
        hybrid={"min_prompt_tokens": 16, **HANDOFF_ALWAYS},
    )
    assert config.hybrid.mode == "share"
    assert [p.__class__.__name__ for p in config.provider] == ["LlamaServerProviderConfig"]
    endpoint = "/v1/chat/completions"
    with trio.fail_after(240):
        async with run_daemon(config) as running:
            provider = running.daemon.models.default.parts.providers.all[0]
            await child_of(provider).wait_state(ChildState.READY)
            expected, _ = await reference_reply(
                running.daemon.models.default.parts.launcher.socket, endpoint, body_for(endpoint, False)
            )
            async with httpx.AsyncClient(base_url=running.url, timeout=120) as client:
                got = [await ask(client, endpoint, body_for(endpoint, stream)) for stream in (False, True)]
    assert got == [expected, expected]
    assert [(line["route"], line["fallback"], line["decoder_prompt_n"]) for line in route_lines.lines] == [
        ("share", None, 1),
        ("share", None, 1),
    ]
    assert list((short_dir / "state").iterdir()) == []


@pytest.mark.parametrize(
    ("fault", "fallback", "said"),
    [
        ("use-slot", "adopt-refused", "was revoked"),
        ("reshare", "adopt-refused", "lent share"),
        ("nothing", "short-claim", "prefilled 0 of"),
        ("short", "short-claim", "into the shared region"),
    ],
    ids=["slot-used-before-adopt", "wrong-share-id", "provider-wrote-nothing", "provider-wrote-too-little"],
)
async def test_a_share_that_cannot_be_adopted_is_served_plain_and_correct(
    short_dir: Path,
    route_lines: RouteLines,
    caplog: pytest.LogCaptureFixture,
    fault: str,
    fallback: str,
    said: str,
) -> None:
    endpoint = "/v1/chat/completions"
    body = body_for(endpoint, False)
    with caplog.at_level(logging.INFO, logger="onebit.hybrid"), trio.fail_after(240):
        async with run_daemon(share_config(short_dir, fault=fault)) as running:
            worker = running.daemon.models.default.parts.providers.all[0]
            await child_of(worker).wait_state(ChildState.READY)
            expected, plain_timings = await plain_reply(
                running.daemon.models.default.parts.launcher.socket, endpoint, body
            )
            async with httpx.AsyncClient(base_url=running.url, timeout=120) as client:
                got = await ask(client, endpoint, body)
    assert got == expected
    (line,) = route_lines.lines
    assert (line["route"], line["fallback"], line["outcome"]) == ("plain", fallback, "ok")
    # Served plain: the decoder evaluated the prompt itself, from an erased slot.
    assert line["decoder_prompt_n"] == plain_timings["prompt_n"]
    messages = [r.getMessage() for r in caplog.records]
    assert any(said in m for m in messages), messages
    assert not any("cannot share its KV" in m for m in messages)


async def test_with_flash_attention_off_the_decoder_refuses_to_share_and_the_file_route_serves(
    short_dir: Path, route_lines: RouteLines, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = "/v1/chat/completions"
    questions = (QUESTION, QUESTION + " Be brief.")
    with caplog.at_level(logging.INFO, logger="onebit.hybrid"), trio.fail_after(240):
        async with run_daemon(share_config(short_dir, decoder_args=("-fa", "off"))) as running:
            worker = running.daemon.models.default.parts.providers.all[0]
            await child_of(worker).wait_state(ChildState.READY)
            async with httpx.AsyncClient(base_url=running.url, timeout=120) as client:
                got = [await ask(client, endpoint, body_for(endpoint, False, q)) for q in questions]
    # No comparison with the plain reply here: without flash attention llama.cpp's CPU kernels for a
    # one-token step and for a whole prompt differ in the last bits, so even the file route's greedy
    # reply can part from the plain one after a few words (seen with SmolLM2).
    assert all(got)
    first, second = route_lines.lines
    assert (first["route"], first["fallback"], first["share_ms"]) == ("file", "share-refused", 0.0)
    assert (second["route"], second["fallback"]) == ("file", "share-refused-earlier")
    assert first["decoder_prompt_n"] <= 2
    refusals = [
        r.getMessage() for r in caplog.records if r.name == "onebit.hybrid" and "cannot share its KV" in r.getMessage()
    ]
    assert len(refusals) == 1
    assert "flash attention is off" in refusals[0]


class Decoder:
    """The patched llama-server started by hand with the share switch, spoken to over its unix socket."""

    def __init__(self, directory: Path, client: httpx.AsyncClient) -> None:
        self.directory = directory
        self.client = client

    async def post(self, url: str, body: dict[str, Any]) -> tuple[int, Any]:
        reply = await self.client.post(url, json=body)
        return reply.status_code, reply.json()

    async def share(self, slot: int, n_tokens: int) -> tuple[dict[str, Any], list[int]]:
        """?action=share, receiving the header and its fds on a socket of our own."""
        path = str(self.directory / f"s{slot}.sock")
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with listener:
            await listener.bind(path)
            listener.listen(1)
            status, data = await self.post(f"/slots/{slot}?action=share", {"socket": path, "n_tokens": n_tokens})
            assert status == 200, data
            conn, _ = await listener.accept()
            with conn:
                raw, ancdata, _flags, _addr = await conn.recvmsg(1 << 20, socket.CMSG_SPACE(16 * 4))
            os.unlink(path)
        fds = [
            int.from_bytes(payload[i : i + 4], sys.byteorder, signed=True)
            for _level, _kind, payload in ancdata
            for i in range(0, len(payload) - len(payload) % 4, 4)
        ]
        header: dict[str, Any] = json.loads(raw[4 : 4 + int.from_bytes(raw[:4], "big")])
        assert header["share_id"] == data["share_id"]
        return header, fds


# What the decoder seals each region it lends with before sending it (patches/llama-server-share.patch).
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def assert_sealed(fd: int) -> None:
    """A lent region as a provider receives it: it can write, and cannot resize the memfd (a shrink
    would leave the decoder's mapping past the new end unbacked: its next access, a SIGBUS)."""
    size = os.fstat(fd).st_size
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == SEALS
    for smaller_or_larger in (0, size // 2, size + 4096):
        with pytest.raises(PermissionError) as raised:
            os.ftruncate(fd, smaller_or_larger)
        assert raised.value.errno == errno.EPERM
    with pytest.raises(PermissionError):
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # nor can it seal the decoder's writes away
    assert os.pwrite(fd, b"\0", size - 1) == 1
    assert os.fstat(fd).st_size == size


async def open_decoder(
    directory: Path, *, ttl_s: str = "", model: Path | None = None, args: tuple[str, ...] = ()
) -> tuple[trio.Process, Path]:
    """The patched llama-server with the share switch: the default model, or ``model``, with ``args``."""
    model = model or locate.model_path(make_config(directory).model.path)
    assert model is not None
    sock = directory / "d.sock"
    env = {**os.environ, "LLAMA_KV_SHARE": "1"}
    if ttl_s:
        env["LLAMA_KV_SHARE_TTL_S"] = ttl_s
    argv = [str(real_llama_server()), "-m", str(model), "-c", "1024", "-np", "2", "-t", "1", *args, "--host", str(sock)]
    process = await trio.lowlevel.open_process(
        [*argv, "--slot-save-path", str(directory), "--no-webui"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    transport = unix_transport(sock)
    async with httpx.AsyncClient(transport=transport, base_url="http://d", timeout=5) as probe:
        while True:  # the server loading its model in its own process: poll its health
            try:
                if (await probe.get("/health")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, "llama-server exited"
            await trio.sleep(0.05)
    return process, sock


async def test_the_decoder_lends_one_slots_region_keeps_it_out_of_its_slot_choice_and_refuses_bad_adopts(
    short_dir: Path,
) -> None:
    with trio.fail_after(120):
        process, sock = await open_decoder(short_dir)
        try:
            transport = unix_transport(sock)
            async with httpx.AsyncClient(transport=transport, base_url="http://d", timeout=60) as client:
                decoder = Decoder(short_dir, client)
                header, fds = await decoder.share(0, 4)
                try:
                    # One fd, one slot's region: each of the 2 slots has its own, so it is half the cache.
                    assert len(fds) == len(header["regions"]) == 1
                    assert os.fstat(fds[0]).st_size == header["regions"][0]["size"]
                    assert_sealed(fds[0])
                    assert header["id_slot"] == 0
                    assert (header["type_k"], header["type_v"], header["v_trans"]) == ("f16", "f16", False)
                    assert len(header["tensors"]) == 2 * header["n_layer"]
                    assert all(t["offset"] % 4096 == 0 for t in header["tensors"])
                finally:
                    for fd in fds:
                        os.close(fd)
                share_id = header["share_id"]

                # llama-server's own slot choice passes over the lent slot.
                for _ in range(2):
                    status, done = await decoder.post("/completion", {"prompt": "Hi there", "n_predict": 1})
                    assert status == 200
                    assert done["id_slot"] == 1

                tokens = [1, 2, 3, 4]
                status, data = await decoder.post(
                    "/slots/0?action=adopt", {"share_id": share_id, "n_tokens": 5, "tokens": [*tokens, 5]}
                )
                assert status == 400
                assert "the share was made for 4" in data["error"]["message"]
                status, data = await decoder.post(
                    "/slots/0?action=adopt", {"share_id": share_id, "n_tokens": 4, "tokens": tokens[:3]}
                )
                assert status == 400
                assert "'tokens' holds 3" in data["error"]["message"]
                status, data = await decoder.post(
                    "/slots/0?action=adopt", {"share_id": "nope", "n_tokens": 4, "tokens": tokens}
                )
                assert status == 400
                assert f"lent share {share_id}, not nope" in data["error"]["message"]

                # An erase drops the pending share.
                status, _ = await decoder.post("/slots/0?action=erase", {})
                assert status == 200
                status, data = await decoder.post(
                    "/slots/0?action=adopt", {"share_id": share_id, "n_tokens": 4, "tokens": tokens}
                )
                assert status == 400
                assert "was erased" in data["error"]["message"]

                # A share adopted as it should be: the slot then holds the tokens.
                header, fds = await decoder.share(1, 4)
                for fd in fds:
                    os.close(fd)
                status, data = await decoder.post(
                    "/slots/1?action=adopt", {"share_id": header["share_id"], "n_tokens": 4, "tokens": tokens}
                )
                assert status == 200, data
                assert data["n_adopted"] == 4
        finally:
            process.kill()
            await process.wait()


async def test_a_share_nobody_adopts_expires(short_dir: Path) -> None:
    with trio.fail_after(120):
        # A bound of one microsecond: the adopt's own round trip outlasts it.
        process, sock = await open_decoder(short_dir, ttl_s="0.000001")
        try:
            transport = unix_transport(sock)
            async with httpx.AsyncClient(transport=transport, base_url="http://d", timeout=60) as client:
                decoder = Decoder(short_dir, client)
                header, fds = await decoder.share(0, 2)
                for fd in fds:
                    os.close(fd)
                status, data = await decoder.post(
                    "/slots/0?action=adopt", {"share_id": header["share_id"], "n_tokens": 2, "tokens": [1, 2]}
                )
        finally:
            process.kill()
            await process.wait()
    assert status == 400
    assert "expired" in data["error"]["message"]
