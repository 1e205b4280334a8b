"""The clients' scenarios: hang-ups, slow readers, a burst past the queue, and malformed HTTP
(chaos/fuzz.py draws the cases).
"""

from __future__ import annotations

import contextvars
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio

from chaos.faults import hang_up_after, open_raw, raw_request, send_case
from chaos.rig import RSS_TOLERANCE_MIB, Onebitd, Run, chaos_config, hybrid_config, open_onebitd, rss_mib
from chaos.traffic import (
    COMPLETIONS,
    LONG,
    REQUEST_BOUND_S,
    SHORT,
    Tally,
    ask,
    ask_until_ok,
    body_for,
    fresh,
    judge_events,
)


async def hang_ups(run: Run, tally: Tally) -> None:
    """Clients that hang up at random moments: queueing, prefill, restore, streaming."""
    n = 30 if run.quick else 100
    config = hybrid_config(run.dir("hangup"), "llama-server", run.dir("hangup-work"), parallel=2)
    rng = random.Random(10)
    async with open_onebitd(config, tally) as od:
        limiter = trio.CapacityLimiter(6)

        async def one(i: int) -> None:
            async with limiter:
                prompt = LONG + f" {i}" if i % 2 else SHORT + f" {i}"
                await hang_up_after(od, body_for(prompt, stream=i % 3 != 0, tokens=16), rng.uniform(0, 3.0))
                tally.add("hung_up")

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        with trio.fail_after(REQUEST_BOUND_S):
            await od.daemon.front.registry.wait_idle()
        tally.check(len(od.lines) == n, f"one route line per request ({len(od.lines)} of {n})")
        outcomes: dict[str, int] = {}
        for line in od.lines:
            outcomes[line["outcome"]] = outcomes.get(line["outcome"], 0) + 1
        tally.figures["outcomes"] = outcomes
        for prompt in (LONG, SHORT):
            for stream in (False, True):
                verdict, note, _ = await ask(
                    od.front, body_for(fresh(prompt, f"after {stream}"), stream=stream, tokens=4)
                )
                tally.add(verdict, note)


async def slow_readers(run: Run, tally: Tally) -> None:
    """Clients reading a long stream slowly: onebitd must not buffer what they have not read."""
    n = 6 if run.quick else 20
    tokens = 96 if run.quick else 400
    config = chaos_config(run.dir("slow"), parallel=n, ctx_per_slot=tokens + 128)
    async with open_onebitd(config, tally) as od:
        await ask_until_ok(od.front, tally, body_for(SHORT, stream=True, tokens=4), bound=60)
        before = rss_mib()
        peak = before
        received: list[int] = []

        async def reader(i: int) -> None:
            # A small receive buffer and 1 KiB every 0.1 s: the stream arrives far faster than it is read.
            body = body_for(f"{SHORT} {i}", stream=True, tokens=tokens, n_probs=5)
            events = b""
            with trio.move_on_after(REQUEST_BOUND_S * 2):
                async with await open_raw(od, rcvbuf=4096) as raw:
                    await raw.send_all(raw_request(COMPLETIONS, body))
                    while chunk := await raw.receive_some(1024):
                        events += chunk
                        await trio.sleep(0.1)
                received.append(len(events))
                head, _, rest = events.partition(b"\r\n\r\n")
                datas = [
                    line[5:].strip().decode()
                    for line in rest.replace(b"\r\n", b"\n").split(b"\n")
                    if line.startswith(b"data:")
                ]
                verdict, note = judge_events(datas, None) if b" 200 " in head[:16] else ("bad", head[:60].decode())
                tally.add(verdict, note)
                return
            tally.add("lost", "a slow reader's stream never ended")

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(reader, i)

            async def watch() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, rss_mib())
                    await trio.sleep(0.2)

            nursery.start_soon(watch)
            while len(received) + tally.lost < n:  # noqa: ASYNC110
                await trio.sleep(0.2)  # the readers' progress: plain counters, polled
            nursery.cancel_scope.cancel()
        streamed = sum(received) / 2**20
        tally.figures.update(
            rss_before_mib=round(before, 1),
            rss_peak_mib=round(peak, 1),
            streamed_mib=round(streamed, 2),
        )
        tally.check(peak - before <= RSS_TOLERANCE_MIB, f"RSS grew {peak - before:.1f} MiB while clients read slowly")


current_req: contextvars.ContextVar[str] = contextvars.ContextVar("current_req", default="")


async def burst(run: Run, tally: Tally) -> None:
    """300 requests at once against queue_limit 64: the overflow gets 503 with Retry-After at once,
    everything admitted completes, and slots are handed out in arrival order."""
    n, queue_limit = 300, 64
    config = chaos_config(run.dir("burst"), parallel=2, server={"queue_limit": queue_limit})
    async with open_onebitd(config, tally) as od:
        completions = od.daemon.models.default.completions
        slots = completions.slots
        arrived: list[str] = []
        granted: list[str] = []
        serve, hold = completions.serve, slots.hold

        async def counting_serve(endpoint: str, body: dict[str, Any], out: Any, story: Any, headers: Any = ()) -> None:
            current_req.set(story.req)
            arrived.append(story.req)
            await serve(endpoint, body, out, story, headers)

        @asynccontextmanager
        async def recording_hold(*args: Any, **kwargs: Any) -> AsyncIterator[int]:
            async with hold(*args, **kwargs) as slot:
                granted.append(current_req.get())
                yield slot

        completions.serve = counting_serve  # type: ignore[method-assign]
        slots.hold = recording_hold  # type: ignore[method-assign]
        refused_s: list[float] = []
        try:
            async with trio.open_nursery() as nursery:

                async def one() -> None:
                    started = trio.current_time()
                    verdict, note, status = await ask(od.front, body_for(SHORT, stream=False, tokens=2))
                    tally.add(verdict, note)
                    if status == 503:
                        refused_s.append(trio.current_time() - started)

                for i in range(n):
                    nursery.start_soon(one)
                    while len(arrived) < i + 1:  # noqa: ASYNC110  # one at a time: arrival order is sending order
                        await trio.sleep(0.001)
        finally:
            completions.serve = serve  # type: ignore[method-assign]
            slots.hold = hold  # type: ignore[method-assign]
        # Recorded once the grant is seen by its task, which trio may schedule a little out of turn
        # among the requests granted at one release: FIFO within `parallel` places.
        position = {req: i for i, req in enumerate(req for req in arrived if req in set(granted))}
        displaced = max((abs(position[req] - i) for i, req in enumerate(granted)), default=0)
        tally.check(displaced <= config.model.parallel, f"slots granted in arrival order (displaced {displaced})")
        tally.figures["most places a grant was out of arrival order"] = displaced
        tally.check(len(refused_s) == tally.clean, "every clean error was a 503")
        tally.check(tally.ok + tally.clean == n, "every request answered")
        tally.check(len(refused_s) > 0, "the burst overflowed the queue")
        tally.check(max(refused_s, default=0) < 5.0, "the overflow was refused at once")
        tally.figures.update(admitted=tally.ok, refused=len(refused_s), slowest_refusal_s=round(max(refused_s), 3))


async def fuzz(run: Run, tally: Tally) -> None:
    """A hypothesis-driven fuzz of heads and bodies; a good request keeps being served meanwhile."""

    config = chaos_config(
        run.dir("fuzz"),
        server={"max_body_bytes": 65536, "body_timeout_s": 1.0, "idle_timeout_s": 1.0},
        # A wrong-typed max_tokens falls back to llama-server's default: keep that short.
        decoder={"extra_args": ["-n", "4"]},
    )
    async with open_onebitd(config, tally) as od:
        await fuzz_front(od, tally, examples=60 if run.quick else 600)


async def fuzz_front(od: Onebitd, tally: Tally, *, examples: int) -> None:
    # chaos/fuzz.py: hypothesis is a test dependency, imported only for this scenario.
    from chaos.fuzz import judge, run_cases

    statuses: dict[str, int] = {}
    done = trio.Event()

    def record(kind: str, raw: bytes, status: int | None, closed: bool) -> None:
        key = f"{kind} {status if status is not None else 'closed'}"
        statuses[key] = statuses.get(key, 0) + 1
        tally.add(*judge(kind, raw, status, closed))

    async def keep_serving() -> None:
        served = 0
        while not done.is_set():
            verdict, note, _ = await ask(od.front, body_for(SHORT, stream=served % 2 == 1, tokens=2), bound=120)
            tally.add(verdict, note)
            served += 1
            with trio.move_on_after(0.5):
                await done.wait()
        tally.figures["good requests served meanwhile"] = served

    async with trio.open_nursery() as nursery:
        nursery.start_soon(keep_serving)
        try:
            await trio.to_thread.run_sync(run_cases, examples, partial(send_case, od), record)
        finally:
            done.set()
    tally.figures["answers"] = dict(sorted(statuses.items()))
    health = await od.front.get("/health")
    tally.check(health.status_code == 200, "onebitd healthy after the fuzz")
