"""Who may see the status surface (``/onebit/``, its files, ``/onebit/status``, ``/onebit/events``):
supervisor/api/access.py's operator rule, as a table of peers and keys, then through the front (the
peer given as the server gives it, ``scope["client"]``), then over a socket from an address of this
machine's that is not loopback.  The feeds' bounds per client: tests/unit/api/test_status_page.py."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import trio

from supervisor.api.access import Access, is_loopback_peer
from supervisor.api.front import Front, Router
from supervisor.api.statuspage import CSP, StatusPage
from supervisor.config import ServerConfig
from supervisor.errors import ClientError
from supervisor.observe.routestats import RouteStats
from tests.rigs import asgi
from tests.rigs.helpers import assert_envelope
from tests.rigs.rig import Control, fake_decoder_config, run_daemon

TIMEOUT = 20  # seconds; a test that needs more is stuck, not slow
PAGE = "/onebit/"
FILES = ("", "page.js", "page.css")
DATA = ("status", "events")
ADMIN = {"authorization": "Bearer the-admin-key"}
ELSEWHERE = "192.0.2.7"  # TEST-NET-1: a client on another machine


def refusal(access: Access, peer: str | None, data: bool, headers: dict[str, str] | None = None) -> tuple[int, str]:
    with pytest.raises(ClientError) as refused:
        access.check_operator(peer, data, headers or {})
    return refused.value.status, refused.value.code


@pytest.mark.parametrize("peer", ["127.0.0.1", "127.0.0.2", "::1", "::ffff:127.0.0.1"])
def test_without_admin_keys_a_loopback_peer_sees_everything_and_is_its_own_client(peer: str) -> None:
    access = Access(ServerConfig())
    assert access.check_operator(peer, True, {}) == peer
    assert access.check_operator(peer, False, {}) == peer


@pytest.mark.parametrize("peer", [ELSEWHERE, "::ffff:192.0.2.7", "fd00::2", "2001:db8::1", None, "localhost", ""])
def test_without_admin_keys_any_other_peer_is_refused_the_page_and_its_data(peer: str | None) -> None:
    access = Access(ServerConfig())
    assert refusal(access, peer, True) == (403, "loopback_only")
    assert refusal(access, peer, False) == (403, "loopback_only")
    # A header naming a loopback client is the client's word, not its address.
    assert refusal(access, peer, True, {"x-forwarded-for": "127.0.0.1", "forwarded": "for=127.0.0.1"})[0] == 403


def test_with_api_keys_a_loopback_peer_needs_one_for_the_data_and_a_key_makes_no_other_peer_loopback() -> None:
    access = Access(ServerConfig(api_keys=("k1", "k2")))
    assert access.check_operator("127.0.0.1", True, {"x-api-key": "k2"}) == "API key 2"
    assert refusal(access, "127.0.0.1", True) == (401, "invalid_api_key")
    assert access.check_operator("127.0.0.1", False, {}) == "127.0.0.1"  # the page asks for the key
    assert refusal(access, ELSEWHERE, True, {"authorization": "Bearer k1"}) == (403, "loopback_only")


def test_with_admin_keys_the_data_need_one_from_every_peer_and_the_files_need_none() -> None:
    access = Access(ServerConfig(api_keys=("api",), admin_keys=("first", "the-admin-key")))
    for peer in (ELSEWHERE, "127.0.0.1", None):
        assert access.check_operator(peer, True, ADMIN) == "admin key 2"
        assert access.check_operator(peer, True, {"x-api-key": "first"}) == "admin key 1"
        assert access.check_operator(peer, False, {}) == ""  # the page's files: it asks for a key
        assert refusal(access, peer, True) == (403, "admin_key_required")
        assert refusal(access, peer, True, {"authorization": "Bearer api"}) == (403, "admin_key_required")
        assert refusal(access, peer, True, {"authorization": "Bearer the-admin"}) == (403, "admin_key_required")


def test_a_reload_that_sets_or_clears_admin_keys_changes_the_rule_at_once() -> None:
    before = ServerConfig()
    access = Access(before)
    assert refusal(access, ELSEWHERE, True, ADMIN) == (403, "loopback_only")
    access.update(ServerConfig(admin_keys=("the-admin-key",)))
    assert access.check_operator(ELSEWHERE, True, ADMIN) == "admin key 1"
    access.update(before)
    assert refusal(access, ELSEWHERE, True, ADMIN) == (403, "loopback_only")


def test_a_peer_is_an_address_never_a_name() -> None:
    assert not is_loopback_peer("localhost")
    assert not is_loopback_peer("app.localhost")
    assert is_loopback_peer("127.255.0.1")


# -- through the front -------------------------------------------------------------------------------


def front_with_page(**server: Any) -> Front:
    # The /onebit/ paths ask nothing of a model: the front is given none.
    front = Front(ServerConfig(**server), cast(Router, None))
    front.page = StatusPage(lambda: {"daemon": {"pid": 4242, "config": "/etc/onebit/onebit.toml"}}, RouteStats())
    return front


@pytest.mark.parametrize("path", [*FILES, *DATA])
async def test_a_client_from_elsewhere_gets_403_for_the_page_its_files_the_status_and_the_feed(path: str) -> None:
    front = front_with_page(host=("0.0.0.0",))
    with trio.fail_after(TIMEOUT):
        reply = await asgi.call(front, "GET", PAGE + path, client=(ELSEWHERE, 40000))
        head = await asgi.call(front, "HEAD", PAGE + path, client=(ELSEWHERE, 40000))
        unknown = await asgi.call(front, "GET", PAGE + path, client=None)
    for answer in (reply, unknown):
        assert answer.status == 403
        assert answer.json()["error"]["code"] == "loopback_only"
        assert answer.json()["error"]["source"] == "onebitd"
        assert answer.headers["content-security-policy"] == CSP
        assert b"4242" not in answer.body
    assert head.status == 403


async def test_a_loopback_client_gets_the_status() -> None:
    front = front_with_page(host=("0.0.0.0",))
    with trio.fail_after(TIMEOUT):
        reply = await asgi.call(front, "GET", PAGE + "status", client=("127.0.0.1", 40000))
    assert reply.status == 200
    assert reply.json()["daemon"]["pid"] == 4242


@pytest.mark.parametrize("path", DATA)
async def test_with_admin_keys_a_client_from_elsewhere_gets_the_data_only_with_one(path: str) -> None:
    front = front_with_page(host=("0.0.0.0",), admin_keys=("the-admin-key",))
    elsewhere = (ELSEWHERE, 40000)
    with trio.fail_after(TIMEOUT):
        refused = await asgi.call(front, "GET", PAGE + path, client=elsewhere)
        loopback = await asgi.call(front, "GET", PAGE + path, client=("127.0.0.1", 40000))
        files = [await asgi.call(front, "GET", PAGE + name, client=elsewhere) for name in FILES]
        status = await asgi.call(front, "GET", PAGE + "status", headers=ADMIN, client=elsewhere)
    for answer in (refused, loopback):
        assert answer.status == 403
        assert answer.json()["error"]["code"] == "admin_key_required"
    assert [answer.status for answer in files] == [200, 200, 200]
    assert status.status == 200


# -- over a socket ---------------------------------------------------------------------------------


def own_address() -> str:
    """An IPv4 address of this machine's that is not loopback; skip where it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # a UDP connect only picks the route: nothing is sent
        except OSError:
            pytest.skip("this machine has no route off loopback")
        address: str = probe.getsockname()[0]
    if is_loopback_peer(address):
        pytest.skip("this machine has no address but loopback")
    return address


async def test_over_a_socket_from_this_machines_own_outer_address_the_status_surface_is_refused(
    short_dir: Path, control: Control
) -> None:
    address = own_address()
    config = fake_decoder_config(short_dir, server={"host": [address]})
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, httpx.AsyncClient(base_url=running.url) as client:
            assert f"//{address}:" in running.url
            answers = {path: await client.get(PAGE + path) for path in (*FILES, *DATA)}
            models = await client.get("/v1/models")  # the API itself answers this client
            status = running.daemon.route_stats.snapshot()
    for path, reply in answers.items():
        assert assert_envelope(reply, 403)["code"] == "loopback_only", path
        assert address in reply.json()["error"]["message"]
    assert models.status_code == 200
    assert status.watchers == 0
