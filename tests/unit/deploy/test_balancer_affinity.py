"""Affinity by conversation at the shipped balancers: three real onebitd hosts behind HAProxy
(config/haproxy.cfg) and behind nginx (config/nginx.conf with its njs module), each request routed
by its conversation's key, consistently hashed.

What is shown, for each balancer: every key a client can give (OpenAI's ``prompt_cache_key``,
Anthropic's ``metadata.user_id``, llama-server's ``X-Conversation-Id``) and, without one, the first
message, is read and routes alike; 16 keys use more than one host; an agent's 8-turn session with a
``prompt_cache_key`` stays on one host and finds its prompt in that host's cache every turn, and so
does a session without a key but with a long system prompt; with HAProxy, a key whose host is
full (hash-balance-factor) overflows to the next host; a host taken out moves only its own keys
(HAProxy: drained, then resumed and they come back; nginx, which checks no /health: stopped).
Behind HAProxy the hosts share one prefix store (``cache.shared_dir``): the drained host saves its
long slots there, and a session that moved finds its whole last prompt restored on its new host.

Where a key lands is asked with a POST to a path onebitd does not serve (``PROBE``): the balancer
has read the body and chosen a host before onebitd answers 404 at once, with no decoding.
"""

from __future__ import annotations

import os
import subprocess
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from tests.rigs.balancers import (
    HAPROXY_CONFIG,
    NGINX_CONFIG,
    HAProxy,
    nginx_argv,
    open_haproxy,
    open_nginx,
    require,
)
from tests.rigs.load import CHAT
from tests.rigs.onebit_hosts import Host, open_hosts

# Three decoders loading and serving on a shared 2-core machine: generous, never reached when well.
DEADLINE_S = 600
PROBE = "/v1/affinity-probe"  # no such endpoint: 404 from onebitd, after the balancer chose a host
KEYS = [f"agent-{i}" for i in range(16)]
TURNS = 8
QUESTIONS = [
    "What is it about?",
    "Give me one example.",
    "And another one?",
    "Which one is the most common?",
    "Why is that?",
    "Where can I see it?",
    "How old is it?",
    "Who studied it first?",
    "Sum it up in one line.",
]


@attrs.frozen
class Front:
    """A balancer as the test sees it: where to send, and who answered."""

    url: str
    answered: Callable[[httpx.Response], str]  # the host that answered, by its balancer's header
    label: Callable[[Host], str]  # the same name for a host we hold


def haproxy_front(haproxy: HAProxy) -> Front:
    # config/haproxy.cfg's X-Onebit-Host: the server's name.
    return Front(haproxy.url, lambda reply: reply.headers["x-onebit-host"], lambda host: host.name)


def nginx_front(url: str) -> Front:
    # config/nginx.conf's X-Onebit-Upstream: every host tried, in order; the last one answered.
    return Front(url, lambda reply: reply.headers["x-onebit-upstream"].split(", ")[-1], lambda host: host.endpoint)


# -- where keys land ----------------------------------------------------------------------------------

CHANNELS: dict[str, Callable[[str], dict[str, Any]]] = {
    # Each probe also carries a first message common to all keys: a key that is not read falls
    # back on it, and every key of that channel lands on one host.
    "prompt_cache_key": lambda key: {
        "json": {"messages": [{"role": "system", "content": "shared"}], "prompt_cache_key": key}
    },
    "metadata.user_id": lambda key: {
        "json": {"system": "shared", "messages": [{"role": "user", "content": "hi"}], "metadata": {"user_id": key}}
    },
    "X-Conversation-Id": lambda key: {
        "json": {"messages": [{"role": "system", "content": "shared"}]},
        "headers": {"x-conversation-id": key},
    },
    "first message": lambda key: {
        "json": {"messages": [{"role": "system", "content": key}, {"role": "user", "content": "hi"}]}
    },
}


async def place(client: httpx.AsyncClient, front: Front, key: str, channel: str = "prompt_cache_key") -> str:
    reply = await client.post(PROBE, **CHANNELS[channel](key))
    assert reply.status_code == 404, reply.text
    return front.answered(reply)


async def placements(client: httpx.AsyncClient, front: Front) -> dict[str, str]:
    return {key: await place(client, front, key) for key in KEYS}


async def check_channels_and_spread(client: httpx.AsyncClient, front: Front, hosts: list[Host]) -> dict[str, str]:
    """Every channel routes a key as prompt_cache_key does, and the keys use more than one host."""
    where = await placements(client, front)
    for channel in CHANNELS:
        assert {key: await place(client, front, key, channel) for key in KEYS} == where, channel
    assert set(where.values()) <= {front.label(host) for host in hosts}
    print(f"\n16 keys over the hosts: {dict(Counter(where.values()))}")
    assert len(set(where.values())) >= 2, where
    return where


def check_only_its_keys_moved(before: Mapping[str, str], after: Mapping[str, str], gone: str) -> None:
    assert gone in before.values()
    for key in KEYS:
        if before[key] == gone:
            assert after[key] != gone, (key, before, after)
        else:
            assert after[key] == before[key], (key, before, after)


# -- agent sessions -----------------------------------------------------------------------------------


class Agent:
    """One conversation, turn after turn: its whole history each time, with or without a key."""

    def __init__(self, client: httpx.AsyncClient, front: Front, *, system: str, key: str | None) -> None:
        self.client = client
        self.front = front
        self.key = key
        self.history: list[dict[str, str]] = [{"role": "system", "content": system}]
        self.turns: list[tuple[str, dict[str, Any]]] = []  # (host, reply) of each turn

    async def say(self, question: str) -> str:
        body: dict[str, Any] = {
            "messages": [*self.history, {"role": "user", "content": question}],
            "max_tokens": 8,
            "temperature": 0,
        }
        if self.key is not None:
            body["prompt_cache_key"] = self.key
        reply = await self.client.post(CHAT, json=body)
        assert reply.status_code == 200, reply.text
        answer: dict[str, Any] = reply.json()
        host = self.front.answered(reply)
        self.turns.append((host, answer))
        self.history += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
        ]
        return host

    async def session(self, turns: int) -> None:
        for question in QUESTIONS[:turns]:
            await self.say(question)


def prompt_tokens(answer: dict[str, Any]) -> int:
    """The prompt's length: the part the decoder evaluated plus the part it found in its cache."""
    return int(answer["timings"]["prompt_n"]) + int(answer["timings"]["cache_n"])


def check_one_host_and_cache_reuse(agent: Agent, expected: str) -> None:
    hosts = [host for host, _ in agent.turns]
    print(f"session (key {agent.key!r}): hosts {hosts}, cache_n {[a['timings']['cache_n'] for _, a in agent.turns]}")
    assert hosts == [expected] * len(agent.turns)
    # Each turn found the whole of the previous turn's prompt in its host's cache.
    for (_, earlier), (_, later) in zip(agent.turns, agent.turns[1:], strict=False):
        assert later["timings"]["cache_n"] >= prompt_tokens(earlier)


def long_system_prompt(topic: str) -> str:
    return f"You are a patient teacher of {topic}. " + f"Explain {topic} simply, one idea at a time. " * 20


async def run_sessions(client: httpx.AsyncClient, front: Front, where: Mapping[str, str]) -> tuple[Agent, Agent]:
    keyed = Agent(client, front, system=long_system_prompt("geology"), key=KEYS[0])
    await keyed.session(TURNS)
    check_one_host_and_cache_reuse(keyed, where[KEYS[0]])
    system = long_system_prompt("astronomy")
    keyless = Agent(client, front, system=system, key=None)
    await keyless.session(TURNS)
    check_one_host_and_cache_reuse(keyless, await place(client, front, system, "first message"))
    return keyed, keyless


async def check_next_turns_after(keyed: Agent, keyless: Agent, gone: str) -> list[Agent]:
    """The sessions' next turns: the one whose host is gone moves, the other stays; those that moved."""
    moved = []
    for agent in (keyed, keyless):
        before = agent.turns[-1][0]
        host = await agent.say(QUESTIONS[TURNS])
        if before == gone:
            assert host != gone
            moved.append(agent)
        else:
            assert host == before
    return moved


def check_restored_from_the_shared_store(moved: list[Agent]) -> None:
    """A moved session's next turn found the whole of its last turn's prompt on its new host: the
    drained host saved its slot into the shared store, the new host restored it.  Without the shared
    store its new host holds none of it (``cache_n`` 0: the session's system prompt is its own)."""
    assert moved
    for agent in moved:
        (_, before), (_, after) = agent.turns[-2:]
        timings = after["timings"]
        print(f"moved session (key {agent.key!r}): cache_n {timings['cache_n']}, prompt_n {timings['prompt_n']}")
        assert after["timings"]["cache_n"] >= prompt_tokens(before), (before["timings"], after["timings"])


async def check_bounded_load(client: httpx.AsyncClient, front: Front, system: str) -> None:
    """HAProxy's ``hash-balance-factor 150``: with one request of a key in flight on its host, that
    host holds more than 150% of the average (one request over three hosts), so the next request of
    the same key goes to the next host on the ring; once the first has ended, back to its own."""
    home = await place(client, front, system, "first message")
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 256,
        "ignore_eos": True,  # 256 tokens: in flight for seconds, the probe below takes milliseconds
        "stream": True,
        "temperature": 0,
    }
    async with client.stream("POST", CHAT, json=body) as reply:
        assert reply.status_code == 200
        assert front.answered(reply) == home
        overflow = await place(client, front, system, "first message")
        await reply.aread()
    assert overflow != home
    assert await place(client, front, system, "first message") == home


# -- the tests ----------------------------------------------------------------------------------------


@pytest.mark.real
async def test_haproxy_keeps_each_conversation_on_one_host_and_a_drain_moves_only_that_hosts_share(
    short_dir: Path,
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with (
            # The hosts share one prefix store (cache.shared_dir): a drained host hands over.
            open_hosts(short_dir, n=3, cache={"shared_dir": str(short_dir / "shared"), "min_tokens": 64}) as hosts,
            open_haproxy(short_dir / "haproxy", hosts) as haproxy,
            httpx.AsyncClient(base_url=haproxy.url, timeout=DEADLINE_S) as client,
        ):
            for host in hosts:
                await haproxy.wait_status(host.name, "UP")
            front = haproxy_front(haproxy)
            where = await check_channels_and_spread(client, front, hosts)
            keyed, keyless = await run_sessions(client, front, where)
            await check_bounded_load(client, front, long_system_prompt("oceanography"))

            gone = next(host for host in hosts if host.name == keyed.turns[-1][0])
            drained = await gone.ctl("drain")
            assert drained.returncode == 0, drained.stderr.decode()
            await haproxy.wait_status(gone.name, "DOWN")
            check_only_its_keys_moved(where, await placements(client, front), gone.name)
            check_restored_from_the_shared_store(await check_next_turns_after(keyed, keyless, gone.name))

            # Back in, it gets its own keys again, and no other.
            resumed = await gone.ctl("resume")
            assert resumed.returncode == 0, resumed.stderr.decode()
            await haproxy.wait_status(gone.name, "UP")
            assert await placements(client, front) == where


@pytest.mark.real
async def test_nginx_keeps_each_conversation_on_one_host_and_a_lost_host_moves_only_its_share(
    short_dir: Path,
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with (
            open_hosts(short_dir, n=3) as hosts,
            open_nginx(short_dir / "nginx", hosts) as nginx,
            httpx.AsyncClient(base_url=nginx.url, timeout=DEADLINE_S) as client,
        ):
            front = nginx_front(nginx.url)
            where = await check_channels_and_spread(client, front, hosts)
            keyed, keyless = await run_sessions(client, front, where)

            # nginx never asks /health, so a drained host would still get its keys (and answer
            # them 503, each retried on the next host): a host nginx sees out is one that is gone.
            gone = next(host for host in hosts if host.endpoint == keyed.turns[-1][0])
            assert await gone.stop() == 0
            check_only_its_keys_moved(where, await placements(client, front), gone.endpoint)
            await check_next_turns_after(keyed, keyless, gone.endpoint)


def test_the_shipped_balancer_configs_parse(tmp_path: Path) -> None:
    """``haproxy -c`` and ``nginx -t`` on the files in config/ as shipped (njs module included)."""
    haproxy = subprocess.run(
        [require("haproxy"), "-c", "-f", str(HAPROXY_CONFIG)],
        env={**os.environ, "ONEBIT_LB_SOCKET": str(tmp_path / "haproxy.sock")},
        capture_output=True,
        text=True,
        check=False,
    )
    assert haproxy.returncode == 0, haproxy.stdout + haproxy.stderr
    nginx = subprocess.run(
        [*nginx_argv(require("nginx"), tmp_path, NGINX_CONFIG), "-t"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert nginx.returncode == 0, nginx.stdout + nginx.stderr
