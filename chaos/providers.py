"""The providers' scenario, one per kind (llama-server, exec, worker): kill -9 and SIGSTOP mid-job."""

from __future__ import annotations

import os
import signal

import trio

from chaos.faults import nursery_done, provider_pid, provider_ready, stopped, wait_provider_job
from chaos.rig import (
    HANG_BOUND_S,
    PREFILL_TIMEOUT_S,
    PROVIDER_START_S,
    SLACK_S,
    Run,
    Scenario,
    hybrid_config,
    open_onebitd,
)
from chaos.traffic import LONG, REQUEST_BOUND_S, Tally, ask, ask_until_ok, body_for, fresh


def provider_fault(kind: str) -> Scenario:
    async def scenario(run: Run, tally: Tally) -> None:
        config = hybrid_config(run.dir(f"prov-{kind}"), kind, run.dir(f"prov-{kind}-work"))
        async with open_onebitd(config, tally) as od:
            await ask_until_ok(od.front, tally, body_for(LONG, stream=False, tokens=4), bound=REQUEST_BOUND_S)
            tally.check((await od.line())["route"] == "file", "the first long prompt takes the file route")
            for fault in ("SIGKILL", "SIGSTOP"):
                child = od.daemon.models.default.parts.providers.all[0].child
                generation = child.generation if child is not None else 0
                result: list[tuple[str, str, int]] = []
                async with trio.open_nursery() as nursery:

                    async def one(result: list[tuple[str, str, int]] = result, fault: str = fault) -> None:
                        result.append(await ask(od.front, body_for(fresh(LONG, fault), stream=False, tokens=4)))

                    nursery.start_soon(one)
                    pid = await wait_provider_job(od)
                    faulted_at = trio.current_time()
                    if fault == "SIGKILL":
                        os.kill(pid, signal.SIGKILL)
                        await nursery_done(result)
                        took = trio.current_time() - faulted_at
                    else:
                        async with stopped(pid):
                            await nursery_done(result)
                            took = trio.current_time() - faulted_at
                            if child is not None:
                                # Its health checks fail (a worker's pings go unanswered): killed, restarted.
                                with trio.move_on_after(HANG_BOUND_S + SLACK_S + PROVIDER_START_S) as waited:
                                    await provider_ready(od, generation)
                                restarted = not waited.cancelled_caught and provider_pid(od) not in (None, pid)
                                tally.check(restarted, "SIGSTOP: the stopped provider is killed and restarted")
                                tally.figures["SIGSTOP to restarted (ready) s"] = round(
                                    trio.current_time() - faulted_at, 2
                                )
                verdict, note, _ = result[0]
                tally.add(verdict, note)
                line = await od.line()
                tally.check(line["route"] == "plain", f"{fault}: the request went plain ({line['route']})")
                tally.check("provider-failed" in (line["fallback"] or ""), f"{fault}: fallback says provider-failed")
                tally.check(took <= PREFILL_TIMEOUT_S + SLACK_S, f"{fault}: plain within prefill_timeout_s")
                tally.figures[f"{fault} answered after s"] = round(took, 2)
                if child is not None:
                    await provider_ready(od, generation)
                await ask_until_ok(
                    od.front, tally, body_for(fresh(LONG, f"again {fault}"), stream=False, tokens=4), bound=120
                )
                tally.check((await od.line())["route"] == "file", f"after {fault}: the file route again")

    scenario.__doc__ = f"kill -9 and SIGSTOP the {kind} provider mid-job"
    return scenario
