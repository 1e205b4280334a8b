"""The ``llama-server`` provider: a second llama-server used only for prefill.

It runs the same model with the same ``-c``/``-np``/batch/cache parameters as the decoder (both
command lines come from the one [model] section) and saves into the decoder's ``--slot-save-path``,
so the state file it writes is one the decoder's restore accepts.  A job is
``POST /completion {"prompt": tokens, "n_predict": 0, "id_slot": k}`` then
``POST /slots/k?action=save {"filename": <name>}``; cancelling it closes that request.

Its ``engine`` is ggml (the decoder's own, on the CPU) or OpenVINO (supervisor/llama/openvino.py).  An
OpenVINO provider asks its runtime for its device before its first start, runs with its compile
cache under onebitd's cache directory, and on the static path (an NPU) with one slot.  Its start is
gated twice: llama-server's /health (the model loaded, the warm-up graph compiled), then ``gate``
(the daemon's fidelity check, supervisor/routes/fidelity.py), run once; a provider the gate refuses runs no
job, says why in ``statistics().refused``, and the other providers go on.
"""

from __future__ import annotations

import logging
import os
import secrets
from functools import partial
from pathlib import Path
from typing import Any

import trio

from ..config import Config, LlamaServerProviderConfig
from ..errors import ChildError, ProviderAnswered, ProviderError
from ..llama import decoder, openvino
from ..llama.decoder import DecoderClient
from ..llama.llama_server import LlamaServerLauncher, connection_limit
from ..llama.region import JobRefused, write_saved_state
from ..llama.slots import PromptKey, SlotPool
from ..supervise.child import Child, ChildState, OnTransition
from .base import Claim, Gate, Job, JobCounts, PrefillJob, ProviderStatistics, ShareJob, log_refusal, verdict

log = logging.getLogger("onebit.provider")


class LlamaServerProvider:
    kind = "llama-server"
    # A share job: it prefills into its own cache, saves the slot, and copies each position's K/V rows
    # from the saved file into the decoder's lent region (supervisor/llama/share_worker.py's format).
    supports_share = True

    def __init__(
        self,
        spec: LlamaServerProviderConfig,
        config: Config,
        *,
        runtime_dir: Path,
        state_dir: Path,
        kv_unified: bool = False,
        swa_full: bool = False,
        device: str | None = None,
        gate: Gate | None = None,
        on_transition: OnTransition | None = None,
    ) -> None:
        """``kv_unified``, ``swa_full``: the model's layout, as in the decoder (supervisor/models/layout.py);
        ``device``: an OpenVINO provider's device as its runtime named it before (None: asked before
        its first start)."""
        self.name = spec.name
        self._swa_full = swa_full
        self.spec = spec
        self.state_dir = state_dir
        engine = openvino.engine_of(spec.engine, spec.binary)
        self.engine: str | None = engine
        # ggml runs on the CPU; an OpenVINO device is known once its runtime was asked (choose_device).
        self.device: str | None = "CPU" if engine == "ggml" else None
        self.compile_dir = openvino.compile_dir(config.cache.compile_dir)
        self.gate = gate
        self.refused: str | None = None
        self._admitted = gate is None
        self.admitted: str | None = None  # the gate's verdict, where it admitted it (its words)
        # Its first start is over (admitted, refused, or that start failed): wait_settled.
        self._settled = trio.Event()
        # engine "auto" that found OpenVINO goes on with ggml when OpenVINO is refused (unfaithful,
        # slower than the decoder's own engine, or unable to start), and says why in ``fell_back``.
        self._falls_back = spec.engine == "auto" and engine == "openvino"
        self.fell_back: str | None = None
        self._config = config
        self.client = DecoderClient(
            runtime_dir / f"provider-{spec.name}.sock", max_connections=connection_limit(config.model.parallel)
        )
        self.launcher = self._launcher(engine, kv_unified)
        self.parallel = config.model.parallel
        if engine == "openvino" and device is not None:
            self._use_device(device)
        self._on_transition = on_transition  # its child's moves, each child it runs: the live feed's
        self.child = self._child()
        # Its own slots, as many as the decoder's (-np is shared) but on the static path; jobs beyond
        # that wait their turn.
        self.slots = SlotPool(self.parallel, queue_limit=1 << 16)
        self.counts = JobCounts()

    def _launcher(self, engine: str, kv_unified: bool) -> LlamaServerLauncher:
        spec, config = self.spec, self._config
        return LlamaServerLauncher(
            f"provider-{spec.name}",
            config,
            binary=spec.ggml_binary(config.decoder.binary),
            binary_path=openvino.llama_server(spec.binary) if engine == "openvino" else None,
            client=self.client,
            slot_save_path=self.state_dir,
            threads=spec.threads,
            extra_args=spec.extra_args,
            kv_unified=kv_unified,
            swa_full=self._swa_full,
        )

    def _child(self) -> Child:
        spec = self.spec
        return Child(
            self.launcher, spec.health, spec.restart, cpu_affinity=spec.cpu_affinity, on_transition=self._on_transition
        )

    def _to_ggml(self) -> None:
        """engine "auto" after OpenVINO was refused: the decoder's own engine, before the next start.
        The layout (``kv_unified``) stays what the daemon chose: every file still restores."""
        self.engine, self.device, self.refused = "ggml", "CPU", None
        self.gate, self._admitted, self._falls_back = None, True, False
        self.launcher = self._launcher("ggml", self.launcher.kv_unified)
        self.child = self._child()
        self.parallel = self._config.model.parallel
        self.slots = SlotPool(self.parallel, queue_limit=1 << 16)

    @property
    def ready(self) -> bool:
        return self.child.state is ChildState.READY and self._admitted

    async def wait_settled(self) -> None:
        await self._settled.wait()

    async def _settle_after_first_start(self, child: Child, *, only_if_failed: bool) -> None:
        """Settled once ``child``'s first start is over; with ``only_if_failed``, only when that
        start failed (a healthy child is settled by its gate's verdict instead)."""
        await child.wait_first_start()
        if not only_if_failed or child.state is not ChildState.READY:
            self._settled.set()

    @property
    def busy(self) -> int:
        return self.counts.busy

    @property
    def static(self) -> bool:
        """On the OpenVINO backend's static-shape path (an NPU, or forced): one slot."""
        return (
            self.engine == "openvino"
            and self.device is not None
            and openvino.is_static(self.device, self.spec.static_shapes, os.environ)
        )

    @property
    def describe(self) -> str:
        """``name=engine/device``, ``/static`` on the static path: for the state fingerprint."""
        return f"{self.name}={self.engine}/{self.device or '?'}" + ("/static" if self.static else "")

    async def run(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            if self.engine == "openvino" and self.device is None and self.refused is None:
                await self.choose_device()
            if self.refused is not None:
                self._settled.set()
                task_status.started(self.child)
                await trio.sleep_forever()
            async with trio.open_nursery() as nursery:
                child = await nursery.start(self.child.run)
                task_status.started(child)
                nursery.start_soon(partial(self._settle_after_first_start, self.child, only_if_failed=True))
                if await self._admit():
                    self._settled.set()
                else:
                    # Nothing will be sent to it: its memory (an OpenVINO server's is about 850 MB)
                    # goes back.
                    nursery.cancel_scope.cancel()
            if self._falls_back and self.refused is not None:
                self._to_ggml()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(partial(self._settle_after_first_start, self.child, only_if_failed=False))
                    await self.child.run()
            self._settled.set()  # refused, and no other engine to go on with
            await trio.sleep_forever()
        finally:
            self._settled.set()  # stopped (its model unloads): its first start is over too
            with trio.CancelScope(shield=True):
                await self.client.aclose()

    async def choose_device(self) -> None:
        """Ask the runtime which devices there are; set the device, its variables and slots.  A
        runtime that cannot say, or lacks the configured device, refuses the provider (one line).
        Before its first start: the daemon asks before the decoder starts (the layout depends on it)."""
        try:
            available = await openvino.list_devices(self.launcher.binary)
        except ChildError as exc:
            self._refuse(str(exc))
            return
        device = openvino.choose_device(self.spec.device, available)
        if device is None:
            self._refuse(f"device {self.spec.device} is not among the runtime's devices ({', '.join(available)})")
            return
        self._use_device(device)
        self.slots = SlotPool(self.parallel, queue_limit=1 << 16)
        static = self.static
        log.info(
            "%s: engine openvino, device %s (of %s)%s; compile cache %s",
            self.name,
            device,
            ", ".join(available),
            ", static shapes, one slot" if static else "",
            self.compile_dir,
        )

    def _use_device(self, device: str) -> None:
        """Run on ``device``: its variables, and one slot on the static path."""
        self.device = device
        self.launcher.engine_env = openvino.environment(
            device, static_shapes=self.spec.static_shapes, cache=self.compile_dir, binary=self.launcher.binary
        )
        if self.static:
            self.parallel = self.launcher.parallel = 1

    async def _admit(self) -> bool:
        """Once its child is ready, run the gate: admitted (True) for as long as the daemon runs, or
        refused (False).  A gate that cannot finish (the child or the decoder died under it) runs again."""
        if self._falls_back and await self.child.wait_state(ChildState.READY, ChildState.FAILED) is ChildState.FAILED:
            # An OpenVINO server that never comes up for this model (it crashes at load, each time
            # its restart policy allows) cannot take it: refused, and engine auto goes on with ggml.
            self._refuse(f"its llama-server did not start ({self.child.statistics().last_exit})")
            return False
        if self.gate is None:
            # Nothing to check (the ggml engine's handoffs are exact): admitted once it is healthy.
            # Settled only then, or when that first start fails: the daemon's readiness waits for it.
            await self.child.wait_state(ChildState.READY)
            return True
        checked = await verdict(self, self.gate, partial(self.child.wait_state, ChildState.READY))
        if checked.refused is not None:
            self._refuse(checked.refused)
            return False
        self._admitted, self.admitted = True, checked.admitted
        return True

    def _refuse(self, why: str) -> None:
        if self._falls_back:
            self.fell_back = f"OpenVINO refused, the ggml engine instead: {why}"
        if self._falls_back and self.child.state is ChildState.STOPPED and self.device is None:
            # Before any start (its device): ggml at once.
            log.warning("%s: engine auto: OpenVINO refused (%s); the ggml engine instead", self.name, why)
            self._to_ggml()
            return
        self.refused = why
        if self._falls_back:
            log.warning(
                "%s: engine auto: OpenVINO refused for this model (%s); the ggml engine instead", self.name, why
            )
        else:
            log_refusal(self.name, why)

    def cached_tokens(self, tokens: tuple[int, ...]) -> int:
        return self.slots.best_cached(PromptKey(tokens=tokens))

    async def prefill(self, job: Job) -> Claim:
        if isinstance(job, ShareJob):
            with self.counts.track():
                async with self.slots.hold(PromptKey(tokens=job.tokens)) as slot:
                    return await self._share_in(slot, job)
        if job.state_file.parent != self.state_dir:
            raise ProviderError(f"{self.name}: state file {job.state_file} is outside {self.state_dir}")
        with self.counts.track():
            # Its slots keep their prompts too: a chat's next turn lands where its prefix is.
            async with self.slots.hold(PromptKey(tokens=job.tokens)) as slot:
                return await self._prefill_in(slot, job)

    async def _prefill_in(self, slot: int, job: PrefillJob) -> Claim:
        client = self.launcher.client
        done = await decoder.prefill(client, slot, job.tokens)
        if isinstance(done, decoder.Refusal):
            raise self._refused(done)
        saved = await decoder.save(client, slot, job.state_file.name)
        if isinstance(saved, decoder.Refusal):
            raise self._refused(saved)
        return Claim(n_tokens=saved.n_saved, prefill_ms=done.prompt_ms, evaluated=done.prompt_n)

    def _refused(self, refused: decoder.Refusal) -> ProviderError:
        # No answer at all: the connection's own words, as the decoder client gave them.
        if refused.status == 0:
            return ProviderError(f"{self.name}: {refused.words}")
        return ProviderAnswered(f"{self.name}: {refused}")

    async def _share_in(self, slot: int, job: ShareJob) -> Claim:
        """Prefill and save as for a file job, then write the saved rows into the lent region."""
        path = self.state_dir / f"share-{job.id}-{secrets.token_hex(4)}.state"
        try:
            done = await self._prefill_in(slot, PrefillJob(job.id, job.model, job.n_ctx, job.tokens, path))
            try:
                written = await trio.to_thread.run_sync(
                    write_saved_state, path, list(job.tokens), job.layout, list(job.fds)
                )
            except (JobRefused, OSError, ValueError, KeyError) as exc:
                raise ProviderError(f"{self.name}: cannot write the shared region: {exc}") from exc
            return Claim(
                n_tokens=written.n_tokens,
                prefill_ms=done.prefill_ms,
                evaluated=done.evaluated,
                state_rows=written.state_rows,
            )
        finally:
            path.unlink(missing_ok=True)

    def statistics(self) -> ProviderStatistics:
        return self.counts.statistics(
            self.name,
            self.kind,
            ready=self.ready,
            child=self.child.statistics(),
            engine=self.engine,
            device=self.device,
            refused=self.refused,
            admitted=self.admitted,
            fell_back=self.fell_back,
        )
