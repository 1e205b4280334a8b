"""Two real onebitd hosts behind nginx, run from config/nginx.conf: drained and restarted one at a
time under load with nothing lost, and a session kept on one host.

Open-source nginx has no active health check, so unlike tests/unit/deploy/test_haproxy.py nothing here waits for
the balancer to take a host out: nginx learns it from the requests themselves (the draining host's
503, then the restarting host's refused connections, each retried on the other host), and it is
seen taking the host back when a reply comes from it again.  Not covered, because nginx has
nothing to show it: when exactly nginx marks a host failed and tries it again (max_fails,
fail_timeout).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.rigs.balancers import assert_status_surface_refused, open_nginx
from tests.rigs.load import CHAT, Load, LongStream
from tests.rigs.onebit_hosts import Host, open_hosts

pytestmark = pytest.mark.real

DEADLINE_S = 300
HOST_HEADER = "x-onebit-upstream"  # set by config/nginx.conf: the host(s) tried, in order
MIN_REQUESTS = 100
FAIL_TIMEOUT_S = 5  # config/nginx.conf's fail_timeout
WORKERS = 4


async def session_on(client: httpx.AsyncClient, host: Host) -> str:
    """An X-Session-Id that nginx's consistent hash sends to ``host`` (asked with GET /health).

    nginx holds a host out for ``fail_timeout`` (5 s) after one failed request (``max_fails=1``),
    and sends its sessions elsewhere meanwhile: a failure during a restart can fall just before
    this (one CI run in a dozen here).  So the 200 sessions are asked again, polled (nginx's state,
    another process's), for up to three fail_timeouts before the host counts as lost."""
    with trio.move_on_after(3 * FAIL_TIMEOUT_S):
        while True:
            for i in range(200):
                session = f"chat-{i}"
                reply = await client.get("/health", headers={"x-session-id": session})
                if reply.headers.get(HOST_HEADER) == host.endpoint:
                    return session
            await trio.sleep(0.5)
    raise AssertionError(f"no session of 200 hashes to {host.endpoint} in {3 * FAIL_TIMEOUT_S} s")


async def drain_and_restart(host: Host, client: httpx.AsyncClient, load: Load) -> dict[str, Any]:
    held = LongStream(client, await session_on(client, host), host_header=HOST_HEADER)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(held.run)
        await held.first.wait()
        drained = await host.ctl("drain", "--timeout", "60")
    assert drained.returncode == 0, drained.stderr.decode()
    progress = drained.stdout.decode().splitlines()
    assert progress[-1] == "drained", progress
    in_flight_at_drain = int(progress[0].split()[1])
    assert in_flight_at_drain >= 1, (progress, held.outcome)
    assert held.outcome is not None
    assert held.outcome.problem is None, held.outcome
    assert held.outcome.host == host.endpoint

    status = await host.restart()
    assert status == 0, f"{host.name}: onebitd exited {status} on SIGTERM"
    # nginx sends it requests again once its fail_timeout has passed: wait for one reply from it.
    back = len(load.outcomes)
    await load.wait_served_by(host.endpoint, back)
    return {"host": host.endpoint, "in_flight_at_drain": in_flight_at_drain}


async def test_rolling_restart_behind_nginx_loses_no_request(short_dir: Path) -> None:
    steps: list[dict[str, Any]] = []
    with trio.fail_after(DEADLINE_S):
        async with (
            open_hosts(short_dir) as hosts,
            open_nginx(short_dir / "nginx", hosts) as nginx,
            httpx.AsyncClient(base_url=nginx.url, timeout=DEADLINE_S) as client,
        ):
            await assert_status_surface_refused(client, hosts[0].url)
            load = Load(client, workers=WORKERS, host_header=HOST_HEADER)
            async with trio.open_nursery() as nursery:
                await nursery.start(load.run)
                await load.wait_finished(10)
                for host in hosts:
                    steps.append(await drain_and_restart(host, client, load))
                await load.wait_finished(max(MIN_REQUESTS, len(load.outcomes) + 10))
                load.stop()
            # A session keeps its host: ask twice.
            session = await session_on(client, hosts[1])
            again = [(await client.post(CHAT, json=short_chat(), headers={"x-session-id": session})) for _ in range(2)]
    figures = {**load.figures(), "retried": sum("," in o.host for o in load.outcomes)}
    print(f"\nrolling restart behind nginx: {figures}; drains: {steps}")
    # nginx's own words on what failed: its error log lines (the access log is on the same file).
    logged = nginx.log.read_text(errors="replace").splitlines()
    said = [i for i, line in enumerate(logged) if "[error]" in line or "[warn]" in line]
    before = logged[max(0, said[0] - 12) : said[0] + 8] if said else []
    assert load.failed() == [], "nginx's log where it first erred:\n" + "\n".join(before)
    assert figures["truncated"] == 0
    assert figures["requests"] >= MIN_REQUESTS
    assert {o.host for o in load.outcomes if "," not in o.host} == {host.endpoint for host in hosts}
    assert [(r.status_code, r.headers[HOST_HEADER]) for r in again] == [(200, hosts[1].endpoint)] * 2


def short_chat() -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}
