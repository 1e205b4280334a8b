"""The decoder's scenarios: it hangs, it is killed during a restore and during the first request
after a restart, and a prefill is cancelled mid-slot.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import trio

from chaos.faults import RestoreKiller, stopped
from chaos.rig import HANG_BOUND_S, SLACK_S, Run, chaos_config, hybrid_config, open_onebitd
from chaos.traffic import (
    COMPLETIONS,
    LONG,
    REQUEST_BOUND_S,
    SHORT,
    Tally,
    ask,
    ask_and_count,
    ask_until_ok,
    body_for,
    fresh,
    judge_events,
)


async def decoder_hang(run: Run, tally: Tally) -> None:
    """SIGSTOP the decoder mid-stream, then mid-prefill: the streams end with an error event within
    HANG_BOUND_S (+ slack), requests sent meanwhile get a clean error, then every request succeeds."""
    async with open_onebitd(chaos_config(run.dir("hang"), parallel=2), tally) as od:
        for phase in ("mid-stream", "mid-prefill"):
            generation = od.daemon.models.default.decoder.generation
            pid = od.daemon.models.default.decoder.pid
            assert pid is not None
            prompt = SHORT if phase == "mid-stream" else " ".join(f"w{i}" for i in range(150))
            body = body_for(prompt, stream=True, tokens=200)
            ended: list[float] = []
            async with trio.open_nursery() as nursery:
                first_token = trio.Event()

                async def one_stream(
                    body: dict[str, Any] = body, first: trio.Event = first_token, ended: list[float] = ended
                ) -> None:
                    events: list[str] = []
                    with trio.move_on_after(REQUEST_BOUND_S):
                        async with od.front.stream("POST", COMPLETIONS, json=body) as reply:
                            async for line in reply.aiter_lines():
                                if line.startswith("data:"):
                                    events.append(line[5:].strip())
                                    first.set()
                    ended.append(trio.current_time())
                    verdict, note = judge_events(events, None)
                    if verdict == "ok":
                        verdict, note = "bad", "a stream that outlived a hung decoder"
                    tally.add(verdict if events else "lost", note or "no event")

                nursery.start_soon(one_stream)
                if phase == "mid-stream":
                    await first_token.wait()
                else:
                    await od.wait_decoder_busy()
                async with stopped(pid):
                    hung_at = trio.current_time()
                    # Requests sent to a hung decoder: a clean error once it is killed, or a 503.
                    for _ in range(2):
                        nursery.start_soon(ask_and_count, od.front, tally, body_for(SHORT, stream=False, tokens=4))
                    await od.wait_decoder_back(generation)
            tally.check(bool(ended) and ended[0] - hung_at <= HANG_BOUND_S + SLACK_S, f"{phase}: stream ended in time")
            tally.figures[f"{phase} stream ended after s"] = round(ended[0] - hung_at, 2) if ended else None
            took = await ask_until_ok(od.front, tally, body_for(SHORT, stream=False, tokens=4), bound=60)
            tally.figures[f"{phase} next ok after s"] = round(took, 2)


async def decoder_kill(run: Run, tally: Tally) -> None:
    """kill -9 the decoder during a restore, then during the first request after its restart."""
    config = hybrid_config(run.dir("kill"), "llama-server", run.dir("kill-work"))
    async with open_onebitd(config, tally) as od:
        hybrid = od.daemon.models.default.parts.hybrid
        assert hybrid is not None
        killer = RestoreKiller(hybrid.file.client, od)
        hybrid.file.client = killer
        generation = od.daemon.models.default.decoder.generation
        verdict, note, _ = await ask(od.front, body_for(LONG, stream=False, tokens=4))
        tally.add(verdict, note)
        tally.check(not killer.armed, "a restore was asked (the kill happened)")
        await od.wait_decoder_back(generation)
        # The first request after the restart, killed once the decoder works on it.
        generation = od.daemon.models.default.decoder.generation
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask_and_count, od.front, tally, body_for(SHORT, stream=True, tokens=200))
            await od.wait_decoder_busy()
            pid = od.daemon.models.default.decoder.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
        await od.wait_decoder_back(generation)
        for prompt in (fresh(LONG, "after the restarts"), SHORT):
            await ask_until_ok(od.front, tally, body_for(prompt, stream=False, tokens=4), bound=60)
        tally.check((await od.line(2))["route"] == "file", "the hybrid route again after the restarts")


async def cancelled_prefill(run: Run, tally: Tally) -> None:
    """A client leaves during a long prefill; llama-server finishes that prefill.  The next request
    (whose prompt shares the abandoned one's start, so slot affinity prefers that slot) must not wait
    behind it: its first token comes before the decoder lets go of the abandoned slot."""
    words = 60 if run.quick else 200
    abandoned = LONG + " " + " ".join(f"item{i}" for i in range(words))
    # Small batches: llama-server interleaves another slot's prompt with the long prefill.
    config = chaos_config(
        run.dir("cprefill"), parallel=2, ctx_per_slot=2048, model={"batch_size": 32, "ubatch_size": 32}
    )
    async with open_onebitd(config, tally) as od:
        # Warm slot 0 so that the abandoned prompt lands on slot 1 (least recently used), and the
        # next request's other slot is 0, whose prompt llama-server batches first.
        await ask_until_ok(od.front, tally, body_for(SHORT, stream=False, tokens=2), bound=60)
        idle_at: list[float] = []
        first_token_at: list[float] = []
        async with trio.open_nursery() as nursery:

            async def leave() -> None:
                with trio.CancelScope() as scope:
                    async with od.front.stream("POST", COMPLETIONS, json=body_for(abandoned, stream=True, tokens=4)):
                        busy = await od.wait_decoder_busy()
                        tally.figures["abandoned slot"] = busy
                        scope.cancel()
                tally.add("hung_up")

            await leave()
            left_at = trio.current_time()

            async def watch_idle() -> None:
                while any(s["is_processing"] for s in await od.decoder_slots() if s["id"] == 1):  # noqa: ASYNC110
                    await trio.sleep(0.02)  # the decoder's slots: another process's state
                idle_at.append(trio.current_time())

            async def next_request() -> None:
                body = body_for(LONG + " next", stream=True, tokens=2)
                events: list[str] = []
                async with od.front.stream("POST", COMPLETIONS, json=body) as reply:
                    async for line in reply.aiter_lines():
                        if line.startswith("data:"):
                            if not first_token_at:
                                first_token_at.append(trio.current_time())
                            events.append(line[5:].strip())
                verdict, note = judge_events(events, 2)
                tally.add(verdict, note)

            nursery.start_soon(watch_idle)
            nursery.start_soon(next_request)
        ttft = first_token_at[0] - left_at
        remaining = idle_at[0] - left_at
        tally.figures.update(next_ttft_s=round(ttft, 2), abandoned_prefill_left_s=round(remaining, 2))
        await od.daemon.front.registry.wait_idle()
        # The abandoned request logs its line last: it holds its slot until the decoder lets go.
        tally.figures["next request's slot"] = [line for line in od.lines if line["outcome"] == "ok"][-1]["slot"]
        tally.check(
            tally.figures["next request's slot"] != tally.figures["abandoned slot"],
            "the next request took the other slot",
        )
        tally.check(ttft < remaining, "the next request's first token came before the abandoned prefill ended")
