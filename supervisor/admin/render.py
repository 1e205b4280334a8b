"""What onebitctl prints for a person: the status table, the route lines ``watch`` shows, the
tables and spans (``5m03s``) they are made of.  Pure: values in, text out."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..observe.routestats import EstimateAccuracy
from ..observe.status import DaemonStatistics, ModelStatistics
from ..prefix.store import StoreStatistics
from ..routeline import RouteLine
from ..routes.rates import RateStatistics


def duration(seconds: float) -> str:
    """A span a person reads at a glance, to its two largest units: 42s, 5m03s, 1h02m, 3d04h."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def stamp(at: float) -> str:
    """A moment as onebitd's log writes it (local time, to the millisecond)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(at)) + f".{int(at * 1000) % 1000:03d}"


def age(seconds: float) -> str:
    """A request's age: tenths of a second while that still means something."""
    return f"{seconds:.1f}s" if seconds < 60 else duration(seconds)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    cells = [list(headers), *([_cell(value) for value in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  ".join(text.ljust(width) for text, width in zip(row, widths, strict=True)).rstrip() for row in cells]


def _estimates(estimates: Sequence[EstimateAccuracy]) -> str:
    """How the cost decision's estimates held: actual over estimated per route and engine."""
    if not estimates:
        return "none yet (no request was routed by cost)"
    return "; ".join(
        f"{e.route}/{e.engine} actual {e.median_ratio:.2f}x the estimate (median), "
        f"{e.within_1_5:.0%} within 1.5x, over {e.n}"
        for e in estimates
    )


def costs_line(costs: RateStatistics | None) -> str:
    """What the cost decision believes now: the prefill rates, the handoff's, the shared-cores slowdowns
    (the status page's costs line, and what ``scripts/bench`` prints at the end of a run)."""
    if costs is None:
        return "not reported (an older onebitd)"
    providers = "".join(f", {name} {rate:.2f}" for name, rate in sorted(costs.providers_ms_per_token.items()))
    return (
        f"prefill ms a token: decoder {costs.decoder_ms_per_token:.2f}{providers}; handoff"
        f" {costs.handoff_ms_per_mib:.1f} ms a MiB; on shared cores a prefill takes {costs.shared:.2f} of"
        f" its overlap with the other child's prefill more ({_measured(costs.shared_samples)}), a provider's"
        f" {costs.decode:.2f} of its overlap with the decoder's other requests ({_measured(costs.decode_samples)})"
    )


def _measured(samples: int) -> str:
    return f"measured over {samples}" if samples else "the prior, none measured yet"


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in sorted(counts.items()))


def render_status(stats: DaemonStatistics) -> str:
    """The status table: what onebitd is doing, for a person."""
    daemon = stats.daemon
    lines = [f"onebitd {daemon.version}: {daemon.state}, pid {daemon.pid}, up {duration(daemon.uptime_s)}"]
    where = [f"config {daemon.config}"] if daemon.config else []
    where.append(f"runtime {daemon.runtime_dir}")
    if daemon.binds:
        where.append("listening on " + ", ".join(daemon.binds))
    lines += ["; ".join(where), ""]
    lines += table(
        ("CHILD", "STATE", "PID", "RESTARTS", "LAST EXIT"),
        [(c.name, c.state, c.pid, c.restarts, c.last_exit) for c in stats.children],
    )
    lines.append("")
    several = stats.models is not None and len(stats.models.models) > 1
    if several:
        lines += _modelstable(stats)
        lines += _models_providers(stats)
    elif stats.providers:
        lines += table(
            ("PROVIDER", "KIND", "ENGINE", "DEVICE", "READY", "BUSY", "JOBS", "FAILURES"),
            [(p.name, p.kind, p.engine, p.device, p.ready, p.busy, p.jobs, p.failures) for p in stats.providers],
        )
        lines += [f"provider {p.name} refused: {p.refused}" for p in stats.providers if p.refused]
        lines += [f"provider {p.name}: {p.fell_back}" for p in stats.providers if p.fell_back]
    else:
        lines.append("providers: none")
    slots = stats.slots
    if not several:  # several: each model's are its SLOTS column
        lines += [
            "",
            f"slots: {slots.busy} busy, {slots.free} free of {slots.total}; "
            f"queue: {slots.queued} waiting (limit {slots.queue_limit})",
        ]
    lines.append("")
    if stats.inflight:
        lines += table(
            ("IN FLIGHT", "ROUTE", "ENDPOINT", "AGE"),
            [(r.req, r.route, r.endpoint, age(r.age_s)) for r in stats.inflight],
        )
    else:
        lines.append("in flight: none")
    requests = _counts(stats.routes) or "none yet"
    if stats.outcomes:
        requests += f" (outcomes: {_counts(stats.outcomes)})"
    if stats.restore_unused:
        requests += f"; restore unused {stats.restore_unused}"
    first = stats.first_byte
    if first.n and first.median_ms is not None and first.p95_ms is not None:
        over = f"the last {first.n} request{'s' if first.n != 1 else ''}"
        first_byte = f"median {first.median_ms:.1f} ms, p95 {first.p95_ms:.1f} ms over {over}"
    else:
        first_byte = "no requests yet"
    lines += [
        "",
        f"requests: {requests}",
        f"fallbacks: {_counts(stats.fallbacks) or 'none'}",
        f"first byte: {first_byte}",
        f"estimates: {_estimates(stats.estimates)}",
        f"costs: {costs_line(stats.costs)}",
    ]
    if stats.models is not None:
        lines += [_restores(m) for m in stats.models.models if m.state == "loaded"]
    if several and stats.models is not None and any(m.store is not None for m in stats.models.models):
        lines += [f"prefix store {m.name}: {_store_line(m.store)}" for m in stats.models.models]
    else:
        lines.append(f"prefix store: {_store_line(stats.store)}")
    return "\n".join(lines) + "\n"


def _models_providers(stats: DaemonStatistics) -> list[str]:
    """Each model's providers (a provider several models name is on each of their rows: READY
    where it runs for that model now)."""
    assert stats.models is not None
    rows = [
        (m.name, p.name, p.kind, p.engine, p.device, p.ready, p.busy, p.jobs, p.failures)
        for m in stats.models.models
        for p in m.providers
    ]
    if not rows:
        return ["providers: none"]
    models = stats.models.models
    refused = [f"provider {p.name} ({m.name}) refused: {p.refused}" for m in models for p in m.providers if p.refused]
    return [
        *table(("MODEL", "PROVIDER", "KIND", "ENGINE", "DEVICE", "READY", "BUSY", "JOBS", "FAILURES"), rows),
        *refused,
    ]


def _modelstable(stats: DaemonStatistics) -> list[str]:
    models = stats.models
    assert models is not None
    rows = [
        (
            m.name + (" (default)" if m.default else ""),
            m.state,
            f"{m.memory_mib:.0f} MiB",
            m.users,
            f"{m.slots.busy}/{m.slots.total}" if m.slots is not None else None,
            m.loads,
            None if m.last_load_ms is None else f"{m.last_load_ms:.0f} ms",
            m.pin,
            f"{m.ttl_s:g}s" if m.ttl_s else None,
        )
        for m in models.models
    ]
    limits = [f"max_loaded {models.max_loaded or '-'}", f"budget {models.memory_budget_mib or '-'} MiB"]
    return [
        *table(("MODEL", "STATE", "MEMORY", "USERS", "SLOTS", "LOADS", "LAST LOAD", "PIN", "TTL"), rows),
        f"models: {models.memory_mib:.0f} MiB resident; {', '.join(limits)}; "
        f"{models.swaps} swaps; {models.waiting} waiting for a load",
        "",
    ]


def _restores(model: ModelStatistics) -> str:
    """``restores <model>: whole (why); 1024 tokens a slot; --swa-full``."""
    said = f"restores {model.name}: {model.restores}"
    if model.restores_why:
        said += f" ({model.restores_why})"
    if model.slot_context is not None:
        said += f"; {model.slot_context} tokens a slot"
    if model.swa_full:
        said += "; --swa-full"
    if model.share_refused:
        said += f"; share route refused: {model.share_refused}"
    return said


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _store_line(store: StoreStatistics | None) -> str:
    if store is None:
        return "-"
    if not store.enabled:
        return "off"
    line = (
        f"{store.entries} entries, {mib(store.bytes)} of {mib(store.max_bytes)} in {store.directory}; "
        f"hits {store.hits}, misses {store.misses}, evictions {store.evictions}, restores {store.restores}"
    )
    if store.restore_ms_mean is not None:
        line += f" (mean {store.restore_ms_mean:.1f} ms)"
    if store.shared:
        line += f", {store.restores_other} from other hosts; shared, as host {store.host_id}"
    if store.shared_problem:
        line += f"; shared directory: {store.shared_problem}"
    return line


_ROUTE_FIELDS = frozenset(a.name for a in attrs.fields(RouteLine))


def route_logfmt(fields: dict[str, Any]) -> str:
    """The route line as onebitd logs it (``-`` for what does not apply)."""
    # Fields a newer daemon added are left out rather than refused.
    return RouteLine(**{k: v for k, v in fields.items() if k in _ROUTE_FIELDS}).logfmt()
