"""Two real onebitd hosts behind HAProxy, run from config/haproxy.cfg: drained and restarted one at a
time under load with nothing lost, and conversations kept on the host that holds their prefix.

Each host is ``onebitd --config FILE`` with its own real llama-server (tests/rigs/onebit_hosts.py), on
127.0.0.2 and 127.0.0.3 with one port; HAProxy checks their /health actively (tests/rigs/balancers.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.rigs.balancers import HAProxy, assert_status_surface_refused, open_haproxy
from tests.rigs.load import CHAT, Load, LongStream
from tests.rigs.onebit_hosts import Host, open_hosts

pytestmark = pytest.mark.real

# Two decoders loading and serving on a shared 2-core machine: generous, never reached when well.
DEADLINE_S = 300
HOST_HEADER = "x-onebit-host"  # set by config/haproxy.cfg: the server that answered
MIN_REQUESTS = 100
# Concurrent clients: one per decoder slot (two hosts of two slots).
WORKERS = 4


async def session_on(client: httpx.AsyncClient, host: str) -> str:
    """An X-Session-Id that HAProxy's consistent hash sends to ``host`` (asked with GET /health)."""
    for i in range(200):
        session = f"chat-{i}"
        reply = await client.get("/health", headers={"x-session-id": session})
        if reply.headers.get(HOST_HEADER) == host:
            return session
    raise AssertionError(f"no session of 200 hashes to {host}")


async def drain_and_restart(host: Host, haproxy: HAProxy, client: httpx.AsyncClient, load: Load) -> dict[str, Any]:
    """The rolling-restart step for one host, each wait checked; what it saw, for the figures."""
    # A stream that is surely in flight on this host when the drain begins.
    held = LongStream(client, await session_on(client, host.name), host_header=HOST_HEADER)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(held.run)
        await held.first.wait()
        drained: list[bytes] = []

        async def drain() -> None:
            result = await host.ctl("drain", "--timeout", "60")
            assert result.returncode == 0, result.stderr.decode()
            drained.append(result.stdout)

        nursery.start_soon(drain)
        await haproxy.wait_status(host.name, "DOWN")  # HAProxy took it out ...
    # ... and the requests it had in flight finished (the drain returned, the held stream ended).
    progress = drained[0].decode().splitlines()
    assert progress[-1] == "drained", progress
    in_flight_at_drain = int(progress[0].split()[1])
    assert in_flight_at_drain >= 1, progress
    assert held.outcome is not None
    assert held.outcome.problem is None, held.outcome
    assert held.outcome.host == host.name

    status = await host.restart()  # SIGTERM: it drains too (nothing is left), then it starts again
    assert status == 0, f"{host.name}: onebitd exited {status} on SIGTERM"
    await haproxy.wait_status(host.name, "UP")
    back = len(load.outcomes)
    await load.wait_served_by(host.name, back)
    return {"host": host.name, "in_flight_at_drain": in_flight_at_drain}


async def test_rolling_restart_behind_haproxy_loses_no_request(short_dir: Path) -> None:
    steps: list[dict[str, Any]] = []
    with trio.fail_after(DEADLINE_S):
        async with (
            open_hosts(short_dir) as hosts,
            open_haproxy(short_dir / "haproxy", hosts) as haproxy,
            httpx.AsyncClient(base_url=haproxy.url, timeout=DEADLINE_S) as client,
        ):
            for host in hosts:
                await haproxy.wait_status(host.name, "UP")
            await assert_status_surface_refused(client, hosts[0].url)
            load = Load(client, workers=WORKERS, host_header=HOST_HEADER)
            async with trio.open_nursery() as nursery:
                await nursery.start(load.run)
                await load.wait_finished(10)
                for host in hosts:
                    steps.append(await drain_and_restart(host, haproxy, client, load))
                await load.wait_finished(max(MIN_REQUESTS, len(load.outcomes) + 10))
                load.stop()
            backend = (await haproxy.stats())["BACKEND"]
    figures = {**load.figures(), "retries": int(backend["wretr"]), "redispatches": int(backend["wredis"])}
    print(f"\nrolling restart behind HAProxy: {figures}; drains: {steps}")
    assert load.failed() == []
    assert figures["truncated"] == 0
    assert figures["requests"] >= MIN_REQUESTS
    assert figures["streamed"] > 0
    assert figures["whole"] > 0
    assert set(figures["by_host"]) == {host.name for host in hosts}


# -- affinity ---------------------------------------------------------------------------------------


def turn(history: Sequence[dict[str, str]], question: str) -> dict[str, Any]:
    return {"messages": [*history, {"role": "user", "content": question}], "max_tokens": 8, "temperature": 0}


async def ask(client: httpx.AsyncClient, session: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A whole reply: the host that served it, and the reply (with the decoder's ``timings``)."""
    reply = await client.post(CHAT, json=body, headers={"x-session-id": session})
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return reply.headers.get(HOST_HEADER, "?"), answer


def prompt_tokens(answer: dict[str, Any]) -> int:
    """The prompt's length: the part the decoder evaluated plus the part it found in its cache."""
    timings = answer["timings"]
    return int(timings["prompt_n"]) + int(timings["cache_n"])


class Chat:
    """One conversation, turn after turn, always with its session id."""

    def __init__(self, client: httpx.AsyncClient, session: str, topic: str) -> None:
        self.client = client
        self.session = session
        # A system prompt of its own, so that two conversations share no more than the template.
        self.history: list[dict[str, str]] = [
            {"role": "system", "content": f"You are a patient teacher of {topic}. " + f"Explain {topic} simply. " * 12}
        ]

    def next_turn(self, question: str) -> dict[str, Any]:
        return turn(self.history, question)

    async def say(self, question: str) -> tuple[str, dict[str, Any]]:
        body = self.next_turn(question)
        host, answer = await ask(self.client, self.session, body)
        self.history += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
        ]
        return host, answer


async def test_a_session_stays_on_the_host_holding_its_prefix_and_moves_when_that_host_drains(
    short_dir: Path,
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with (
            open_hosts(short_dir) as hosts,
            open_haproxy(short_dir / "haproxy", hosts) as haproxy,
            httpx.AsyncClient(base_url=haproxy.url, timeout=DEADLINE_S) as client,
        ):
            one, two = hosts
            for host in hosts:
                await haproxy.wait_status(host.name, "UP")
            chats = [
                Chat(client, await session_on(client, one.name), "geology"),
                Chat(client, await session_on(client, two.name), "astronomy"),
            ]
            first = [await chat.say("What is it about?") for chat in chats]
            second = [await chat.say("Give me one example.") for chat in chats]

            # The same second turn of the first chat, sent past HAProxy to the other host: what
            # it would have cost there (a host that never saw the conversation).
            async with httpx.AsyncClient(base_url=two.url, timeout=DEADLINE_S) as straight:
                elsewhere = (await straight.post(CHAT, json=turn(chats[0].history[:-2], "Give me one example."))).json()

            # Drain the first host while HAProxy still counts it in (its checks paused): the next
            # turn reaches it, gets its 503, and is retried on the other host.
            await haproxy.command(f"disable health onebit/{one.name}")
            drained = await one.ctl("drain")
            assert drained.returncode == 0, drained.stderr.decode()
            before = (await haproxy.stats())["BACKEND"]
            third = await chats[0].say("And another one?")
            after = (await haproxy.stats())["BACKEND"]
            await haproxy.command(f"enable health onebit/{one.name}")
            await haproxy.wait_status(one.name, "DOWN")
            fourth = await chats[0].say("Which one is the most common?")
            other = await chats[1].say("And another one?")

    print(
        "\naffinity: cache_n of turn 2 on its own host "
        f"{[answer['timings']['cache_n'] for _, answer in second]} of {[prompt_tokens(a) for _, a in first]} "
        f"tokens of turn 1; on the other host {elsewhere['timings']['cache_n']}"
    )
    # Every turn of a conversation reaches the host its session hashes to.
    assert [host for host, _ in first] == [one.name, two.name]
    assert [host for host, _ in second] == [one.name, two.name]
    # There the whole of the previous turn's prompt was found in the decoder's cache ...
    for (_, earlier), (_, later) in zip(first, second, strict=True):
        assert later["timings"]["cache_n"] >= prompt_tokens(earlier)
    # ... which the other host, never having seen the conversation, would have had to evaluate.
    assert elsewhere["timings"]["cache_n"] < prompt_tokens(first[0][1])
    # Drained, the first host refused the third turn (503) and HAProxy sent it to the other one.
    assert third[0] == two.name
    assert int(after["wredis"]) > int(before["wredis"])
    # Taken out, the first host's conversation now lives on the other host, prefix included.
    assert fourth[0] == two.name
    assert fourth[1]["timings"]["cache_n"] >= prompt_tokens(third[1])
    assert other[0] == two.name
