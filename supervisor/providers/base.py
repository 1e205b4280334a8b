"""Prefill providers: what a provider is to the rest of onebit, and how one is picked.

A provider takes a :class:`PrefillJob` (the prompt's exact tokens and where to put their KV) and
answers a :class:`Claim` (how many tokens it says it prefilled, in how long).  Three kinds implement
the :class:`Provider` protocol: ``llama-server`` (llama.py), ``exec`` (exec.py) and ``worker``
(worker.py).  The wire contract a vendor implements is docs/protocol.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import attrs
import trio

from ..errors import ProviderError
from ..llama.region import STATE_KINDS
from ..reasons import Reason
from ..supervise.child import Child, ChildStatistics

log = logging.getLogger("onebit.provider")


@attrs.frozen
class Checked:
    """A start-time check's verdict on a provider: ``refused``, why it takes no job (None: admitted);
    ``admitted``, the words it was admitted with (its fidelity distances; None: nothing measured)."""

    refused: str | None = None
    admitted: str | None = None


# The start-time check a provider passes before its first job (the daemon's fidelity check,
# supervisor/models/admission.py): its verdict.
Gate = Callable[["Provider"], Awaitable[Checked]]
# A check that raised ProviderError (a child restarting under it) is tried again this much later:
# about what a llama-server restart takes with the small models this runs.
GATE_RETRY_S = 5.0


def log_refusal(name: str, why: str) -> None:
    log.error("provider %s: refused for this model, the other providers go on: %s", name, why)


async def verdict(provider: Provider, gate: Gate, ready: Callable[[], Awaitable[object]]) -> Checked:
    """``gate``'s verdict on ``provider`` once ``ready`` returns (its child healthy, or at once for a
    kind with none).  A check that cannot finish (the child or the decoder died under it) runs
    again, after the next ``ready``."""
    while True:
        await ready()
        try:
            return await gate(provider)
        except ProviderError as exc:
            log.warning("%s: the start-time check did not finish (%s); again in %gs", provider.name, exc, GATE_RETRY_S)
            await trio.sleep(GATE_RETRY_S)


@attrs.frozen
class PrefillJob:
    id: str
    model: str
    n_ctx: int
    tokens: tuple[int, ...]
    state_file: Path  # absolute; the name is onebitd's, never the client's

    def wire(self) -> dict[str, Any]:
        """The job as the exec/worker contract sends it."""
        return {
            "id": self.id,
            "route": "file",
            "model": self.model,
            "n_ctx": self.n_ctx,
            "tokens": list(self.tokens),
            "state_file": str(self.state_file),
        }


@attrs.frozen
class ShareJob:
    """A share-route job: write the K/V rows of positions 0..M-1 straight into the decoder's region."""

    id: str
    model: str
    n_ctx: int
    tokens: tuple[int, ...]
    share_id: str
    layout: dict[str, Any]  # the decoder's header: regions, tensors (offset, row_bytes), align
    fds: tuple[int, ...]  # our descriptors of the regions, in the order of layout["regions"]

    def wire(self, fds: list[int] | None = None) -> dict[str, Any]:
        """The job as sent; ``fds``: the numbers the provider will see them at (exec: ours)."""
        return {
            "id": self.id,
            "route": "share",
            "model": self.model,
            "n_ctx": self.n_ctx,
            "tokens": list(self.tokens),
            "share_id": self.share_id,
            "layout": self.layout,
            "fds": list(self.fds if fds is None else fds),
        }

    @property
    def state_rows(self) -> int:
        """The recurrent state rows the decoder lends (a hybrid model's; 0: none), each of which the
        provider must write and claim: the staging region still holds the previous share's."""
        return sum(1 for tensor in self.layout.get("tensors") or () if tensor.get("kind") in STATE_KINDS)


Job = PrefillJob | ShareJob


@attrs.frozen
class Claim:
    """What a provider says it did.  ``None`` fields: its last line did not say (not an error)."""

    n_tokens: int | None = None
    prefill_ms: float | None = None
    # Tokens it evaluated (a provider with a prompt cache evaluates only what it lacked); None: all.
    evaluated: int | None = None
    # A share job's recurrent state rows it wrote (ShareJob.state_rows); None: it did not say, which
    # for a hybrid model's share means the decoder's staging region is not the job's.
    state_rows: int | None = None


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_claim(line: str) -> Claim:
    """The claim from a provider's last stdout line; a line that does not parse claims nothing."""
    try:
        data = json.loads(line)
    except ValueError:
        return Claim()
    if not isinstance(data, dict):
        return Claim()
    prefill_ms = data.get("prefill_ms")
    return Claim(
        n_tokens=_integer(data.get("n_tokens")),
        prefill_ms=float(prefill_ms)
        if isinstance(prefill_ms, int | float) and not isinstance(prefill_ms, bool)
        else None,
        state_rows=_integer(data.get("state_rows")),
    )


@attrs.define
class JobCounts:
    """Jobs in progress, started and failed: the same bookkeeping for every provider kind."""

    busy: int = 0
    jobs: int = 0
    failures: int = 0

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self.busy += 1
        self.jobs += 1
        try:
            yield
        except ProviderError:
            self.failures += 1
            raise
        finally:
            self.busy -= 1

    def statistics(
        self,
        name: str,
        kind: str,
        *,
        ready: bool,
        child: ChildStatistics | None = None,
        engine: str | None = None,
        device: str | None = None,
        refused: str | None = None,
        admitted: str | None = None,
        fell_back: str | None = None,
    ) -> ProviderStatistics:
        """A provider's snapshot; ``child``: its supervised child's statistics, if it has one."""
        return ProviderStatistics(
            name=name,
            kind=kind,
            ready=ready,
            busy=self.busy,
            jobs=self.jobs,
            failures=self.failures,
            child=child,
            engine=engine,
            device=device,
            refused=refused,
            admitted=admitted,
            fell_back=fell_back,
        )


@attrs.frozen
class ProviderStatistics:
    name: str
    kind: str
    ready: bool
    busy: int
    jobs: int
    failures: int
    child: ChildStatistics | None  # the supervised child's statistics, for kinds that have one
    # What a llama-server provider computes on (engine ggml or openvino, and the device it resolved);
    # None for the kinds that do not say.
    engine: str | None = None
    device: str | None = None
    # Why it takes no jobs although it runs: its device is not there, or its replies are too far from
    # the decoder's (supervisor/routes/fidelity.py).  Set once, at start.
    refused: str | None = None
    # The start-time check's verdict it was admitted with (its fidelity distances); None where no
    # check ran (the ggml engine's handoffs are exact, no hybrid route) or it was refused.
    admitted: str | None = None
    # engine "auto": why OpenVINO was refused and the ggml engine runs instead (its figures where
    # the start-time check measured it slower); None where it was not.
    fell_back: str | None = None


class Provider(Protocol):
    name: str
    kind: str
    # What it computes on, for the route line, the metrics and onebitctl status: a llama-server
    # provider's engine ("ggml", "openvino") and device ("CPU", "NPU", ...); None where not known.
    engine: str | None
    device: str | None
    # Can take a ShareJob (write into the decoder's region); llama-server providers cannot.
    supports_share: bool

    @property
    def admitted(self) -> str | None:
        """The words its start-time check admitted it with (:attr:`Checked.admitted`); None where
        no check measured it, or it was refused."""

    @property
    def child(self) -> Child | None:
        """The child it supervises between jobs (a llama-server, a worker); None for a kind that
        starts a process per job (exec)."""

    @property
    def ready(self) -> bool:
        """Can take a job now (its child is healthy, or it needs none)."""

    @property
    def busy(self) -> int:
        """Jobs in progress."""

    async def run(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        """Supervise whatever the provider needs for as long as the daemon runs."""

    async def wait_settled(self) -> None:
        """Until its first start is over: it takes jobs, or its start failed, or it was refused.
        The daemon's readiness waits for every provider's (requests before it would go plain)."""

    def cached_tokens(self, tokens: tuple[int, ...]) -> int:
        """Prompt tokens a job for ``tokens`` would find in the provider's own cache (0: none kept)."""

    async def prefill(self, job: Job) -> Claim:
        """Prefill ``job.tokens`` into ``job.state_file`` (or the shared region).  Raises ProviderError on failure;
        cancelling it cancels the job (and kills or tells whatever runs it)."""

    def statistics(self) -> ProviderStatistics: ...


class Providers:
    """The configured providers; :meth:`pick` chooses a ready one with the fewest jobs."""

    def __init__(self, providers: list[Provider]) -> None:
        self.all = providers

    def pick(self) -> Provider | None:
        ready = [p for p in self.all if p.ready]
        if not ready:
            return None
        return min(ready, key=lambda p: p.busy)

    def away(self) -> Reason | None:
        """No provider was ready: when one is a shared provider running for another model, ask for
        it (supervisor/providers/seat.py) and say why this request goes without it."""
        reasons = [claim() for p in self.all if (claim := getattr(p, "claim", None)) is not None]
        for reason in (Reason.PROVIDER_SWAPPING, Reason.PROVIDER_OTHER_MODEL):
            if reason in reasons:
                return reason
        return None

    def statistics(self) -> list[ProviderStatistics]:
        return [p.statistics() for p in self.all]
