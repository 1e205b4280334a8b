"""The machine's scenarios: the state directory fills up, and a soak (memory and fds over a long run)."""

from __future__ import annotations

import random

import trio

from chaos.faults import hang_up_after
from chaos.rig import FD_TOLERANCE, RSS_TOLERANCE_MIB, Run, Skipped, fds, hybrid_config, open_onebitd, rss_mib
from chaos.traffic import LONG, REQUEST_BOUND_S, SHORT, Tally, ask, ask_until_ok, body_for, fresh


async def disk_full(run: Run, tally: Tally) -> None:
    """state/ on a 64 KiB tmpfs: the state write fails, the request goes plain, nothing half-written."""
    runtime = run.dir("full")
    state = runtime / "state"
    state.mkdir(exist_ok=True)
    # A state file of this prompt is ~23 KiB per token: 64 KiB holds none of them.
    mounted = await trio.run_process(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(state)], capture_stderr=True, check=False
    )
    if mounted.returncode != 0:
        raise Skipped(f"cannot mount a tmpfs (needs root and CAP_SYS_ADMIN): {mounted.stderr.decode().strip()}")
    try:
        async with open_onebitd(hybrid_config(runtime, "llama-server", run.dir("full-work")), tally) as od:
            for stream in (False, True):
                verdict, note, _ = await ask(od.front, body_for(fresh(LONG, stream), stream=stream, tokens=4))
                tally.add(verdict, note)
                line = await od.line()
                tally.check(line["route"] == "plain", "a full disk: the request went plain")
                tally.check(line["fallback"] == "provider-failed", f"the route line says why ({line['fallback']})")
                tally.check(list(state.iterdir()) == [], "nothing half-written is left in state/")
            tally.figures["route line fallback"] = (await od.line())["fallback"]
    finally:
        with trio.CancelScope(shield=True):
            await trio.run_process(["umount", "-l", str(state)], check=False)


async def soak(run: Run, tally: Tally) -> None:
    """Mixed requests (plain and file, streamed and whole, 5% hang-ups): fds, RSS, runtime dir after."""
    n = 200 if run.quick else 5000
    config = hybrid_config(run.dir("soak"), "llama-server", run.dir("soak-work"), parallel=4)
    rng = random.Random(7)
    async with open_onebitd(config, tally) as od:
        for prompt in (LONG, SHORT):  # warm: the pools, the rates
            await ask_until_ok(od.front, tally, body_for(prompt, stream=True, tokens=4), bound=120)
        fd_before, rss_before = fds(), rss_mib()
        limiter = trio.CapacityLimiter(6)

        async def one(i: int) -> None:
            async with limiter:
                prompt = (LONG if rng.random() < 0.5 else SHORT) + f" {i}"
                body = body_for(prompt, stream=rng.random() < 0.5, tokens=rng.choice((2, 4, 8)), chat=False)
                if rng.random() < 0.05:
                    await hang_up_after(od, {**body, "stream": True}, rng.uniform(0, 2.0))
                    tally.add("hung_up")
                    return
                verdict, note, _ = await ask(od.front, body)
                tally.add(verdict, note)

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        with trio.fail_after(REQUEST_BOUND_S):
            await od.daemon.front.registry.wait_idle()
        fd_after, rss_after = fds(), rss_mib()
        routes: dict[str, int] = {}
        for line in od.lines:
            routes[line["route"] or "none"] = routes.get(line["route"] or "none", 0) + 1
        tally.figures.update(
            fds=f"{fd_before} -> {fd_after}",
            rss_mib=f"{rss_before:.1f} -> {rss_after:.1f}",
            routes=routes,
        )
        tally.check(fd_after - fd_before <= FD_TOLERANCE, f"fd drift {fd_after - fd_before} within {FD_TOLERANCE}")
        tally.check(rss_after - rss_before <= RSS_TOLERANCE_MIB, f"RSS drift within {RSS_TOLERANCE_MIB} MiB")
