"""``GET /metrics``: Prometheus text format, from the route lines and live statistics.

Per-request numbers are taken from the route line when it is emitted, so the metrics and the logs
can never disagree.  Live numbers (children, slots, queue, drain) are read when scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from ..llama.slots import SlotStatistics
from ..prefix.store import StoreStatistics
from ..providers.base import ProviderStatistics
from ..routeline import RouteLine
from ..supervise.child import ChildStatistics
from .status import FrontStatistics, ModelsStatistics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The *_created series double every counter's output and tell an operator nothing here.
disable_created_metrics()  # type: ignore[no-untyped-call]

# From a cached one-token reply (a few ms) to a long prompt on a slow CPU (a minute).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A restore or a share handshake is a memory copy or a few syscalls: far under a second.
_HANDOFF_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@attrs.frozen
class LiveStatistics:
    """What a scrape reads live, from each owner's ``statistics()``."""

    children: tuple[ChildStatistics, ...]
    slots: SlotStatistics
    front: FrontStatistics
    restore_unused: int
    store: StoreStatistics
    providers: tuple[ProviderStatistics, ...] = ()
    models: ModelsStatistics | None = None


Snapshot = Callable[[], LiveStatistics]


class _Live(Collector):
    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        stats = self._snapshot()
        restarts = CounterMetricFamily("onebit_child_restarts", "Restarts of a supervised child", labels=["child"])
        state = GaugeMetricFamily(
            "onebit_child_state", "1 for the state a supervised child is in", labels=["child", "state"]
        )
        for child in stats.children:
            restarts.add_metric([child.name], child.restarts)
            for name in ("stopped", "starting", "ready", "backoff", "failed", "stopping"):
                state.add_metric([child.name, name], 1.0 if child.state == name else 0.0)
        yield restarts
        yield state
        several = stats.models is not None and len(stats.models.models) > 1
        if several and stats.models is not None:
            # Each model's providers and prefix store, labelled by model (the default's alone otherwise).
            owned: list[tuple[str | None, ProviderStatistics]] = [
                (m.name, p) for m in stats.models.models for p in m.providers
            ]
            if owned:
                yield from _providers(owned, by_model=True)
        elif stats.providers:
            yield from _providers([(None, p) for p in stats.providers], by_model=False)
        if stats.models is not None:
            yield from _models(stats.models)
        slots = stats.slots
        yield GaugeMetricFamily("onebit_slots_busy", "Decoder slots held by requests", value=slots.busy)
        yield GaugeMetricFamily("onebit_slots", "Decoder slots", value=slots.total)
        yield GaugeMetricFamily("onebit_queue_depth", "Requests waiting for a slot", value=slots.queued)
        inflight = len(stats.front.inflight)
        yield GaugeMetricFamily("onebit_inflight_requests", "Completion requests in flight", value=inflight)
        yield GaugeMetricFamily("onebit_draining", "1 while draining", value=1.0 if stats.front.draining else 0.0)
        yield CounterMetricFamily(
            "onebit_restore_unused",
            "Requests whose decoder re-evaluated the prompt despite a successful restore (a handoff, the prefix store)",
            value=stats.restore_unused,
        )
        stores: list[tuple[str | None, StoreStatistics]] = [(None, stats.store)]
        if several and stats.models is not None:
            stores = [(m.name, m.store) for m in stats.models.models if m.store is not None] or stores
        yield from _stores(stores)


def _field(name: str, store: StoreStatistics) -> float:
    value: float = getattr(store, name)
    return value


def _stores(stores: list[tuple[str | None, StoreStatistics]]) -> Iterator[Any]:
    """The prefix store's figures; labelled ``model`` when there are several models' stores."""
    labels = ["model"] if stores[0][0] is not None else []

    def family(kind: type[Any], name: str, what: str, value: Callable[[StoreStatistics], float]) -> Any:
        metric = kind(name, what, labels=labels)
        for model, store in stores:
            metric.add_metric([model] if model is not None else [], value(store))
        return metric

    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    yield family(gauge, "onebit_prefix_store_enabled", "1 while the prefix store is on", lambda s: float(s.enabled))
    yield family(gauge, "onebit_prefix_store_entries", "Prefixes in the store", lambda s: s.entries)
    yield family(gauge, "onebit_prefix_store_bytes", "Bytes the store holds on disk", lambda s: s.bytes)
    yield family(gauge, "onebit_prefix_store_max_bytes", "cache.max_bytes", lambda s: s.max_bytes)
    for name, what in (
        ("hits", "Lookups that found a stored prefix"),
        ("misses", "Lookups that found none"),
        ("evictions", "Entries evicted to stay within cache.max_bytes"),
        ("stores", "Entries committed"),
        ("store_failures", "Entries dropped by a failed write (disk full, ...)"),
        ("drops", "Entries dropped: refused or unused by the decoder, or stale at start"),
        ("restores", "Stored prefixes restored into a decoder slot"),
    ):
        yield family(counter, f"onebit_prefix_store_{name}", what, partial(_field, name))
    # Of the restores, by whose entry: this host's, or another's in a shared store (cache.shared_dir).
    origin = CounterMetricFamily(
        "onebit_prefix_store_origin_restores",
        "Stored prefixes restored, by the host that stored them: self or other (a shared store)",
        labels=[*labels, "origin"],
    )
    for model, store in stores:
        named = [model] if model is not None else []
        origin.add_metric([*named, "self"], store.restores - store.restores_other)
        origin.add_metric([*named, "other"], store.restores_other)
    yield origin
    yield family(
        gauge,
        "onebit_prefix_store_shared",
        "1 while the store is a directory the hosts share",
        lambda s: float(s.shared),
    )
    # In seconds, summed: rate(this) / rate(onebit_prefix_store_restores_total) is the mean.
    yield family(
        counter,
        "onebit_prefix_store_restore_seconds",
        "Time spent restoring stored prefixes into decoder slots",
        lambda s: (s.restore_ms_mean or 0.0) * s.restores / 1000,
    )


# What a model's restores can do (supervisor/routes/capability.py's Restores, and withdrawn).
RESTORES = ("unprobed", "whole", "prefix", "none", "withdrawn")
# A model's states (supervisor/models/model.py's ModelState), in the order they come.
MODEL_STATES = ("unloaded", "loading", "loaded", "failed", "unloading")


def _models(models: ModelsStatistics) -> Iterator[Any]:
    """Per model: its state, its memory (measured while loaded, else estimated), loads, requests
    holding it; the swaps the scheduler made."""
    state = GaugeMetricFamily("onebit_model_state", "1 for the state a model is in", labels=["model", "state"])
    memory = GaugeMetricFamily(
        "onebit_model_memory_bytes",
        "A model's memory: its children's RSS while loaded, else estimated",
        labels=["model"],
    )
    loads = CounterMetricFamily("onebit_model_loads", "Times a model was loaded", labels=["model"])
    users = GaugeMetricFamily("onebit_model_users", "Requests holding a model", labels=["model"])
    busy = GaugeMetricFamily("onebit_model_slots_busy", "A model's decoder slots held by requests", labels=["model"])
    queued = GaugeMetricFamily("onebit_model_queue_depth", "Requests waiting for a slot of a model", labels=["model"])
    restores = GaugeMetricFamily(
        "onebit_model_restores",
        "1 for what a model's restores can do this load: unprobed, whole, prefix, none, withdrawn",
        labels=["model", "restores"],
    )
    for model in models.models:
        for name in RESTORES:
            restores.add_metric([model.name, name], 1.0 if model.restores == name else 0.0)
        if model.slots is not None:
            busy.add_metric([model.name], model.slots.busy)
            queued.add_metric([model.name], model.slots.queued)
        for name in MODEL_STATES:
            state.add_metric([model.name, name], 1.0 if model.state == name else 0.0)
        memory.add_metric([model.name], model.memory_mib * 1024 * 1024)
        loads.add_metric([model.name], model.loads)
        users.add_metric([model.name], model.users)
    yield from (state, memory, loads, users, busy, queued, restores)
    yield CounterMetricFamily("onebit_model_swaps", "Models unloaded to make room for another", value=models.swaps)
    yield GaugeMetricFamily("onebit_model_waiting", "Requests waiting for their model to load", value=models.waiting)


def _providers(providers: list[tuple[str | None, ProviderStatistics]], *, by_model: bool) -> Iterator[Any]:
    """Per provider, labelled with what it computes on (and, ``by_model``, the model it prefills
    for: a provider several models name is on each one's series): ready (0 while refused), jobs,
    failures."""
    labels = [*(["model"] if by_model else []), "provider", "kind", "engine", "device"]
    ready = GaugeMetricFamily("onebit_provider_ready", "1 while a provider takes jobs", labels=labels)
    refused = GaugeMetricFamily(
        "onebit_provider_refused", "1 for a provider refused at start (device missing, fidelity)", labels=labels
    )
    jobs = CounterMetricFamily("onebit_provider_jobs", "Prefill jobs a provider was given", labels=labels)
    failures = CounterMetricFamily(
        "onebit_provider_failures", "Prefill jobs a provider failed (the request went plain)", labels=labels
    )
    for model, p in providers:
        where = [*([model or "-"] if by_model else []), p.name, p.kind, p.engine or "-", p.device or "-"]
        ready.add_metric(where, 1.0 if p.ready else 0.0)
        refused.add_metric(where, 1.0 if p.refused else 0.0)
        jobs.add_metric(where, p.jobs)
        failures.add_metric(where, p.failures)
    yield from (ready, refused, jobs, failures)


class Children:
    """Each labelled metric's child for a set of label values, made once and kept: prometheus-client's
    ``labels()`` checks and converts the values and takes the metric's lock on every call, and every
    request asks for five or six.  The label values are routes, outcomes, fallback reasons and model
    names, so what is kept is what prometheus-client's metrics keep themselves."""

    def __init__(self) -> None:
        self._made: dict[tuple[Any, ...], Any] = {}

    def __call__(self, metric: MetricWrapperBase, *values: str) -> Any:
        key = (metric, *values)
        child = self._made.get(key)
        if child is None:
            child = self._made[key] = metric.labels(*values)
        return child


class Metrics:
    def __init__(self, snapshot: Snapshot) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "onebit_requests",
            "Completion requests by route, outcome and fallback reason",
            ["route", "outcome", "fallback"],
            registry=self.registry,
        )
        self.first_byte = Histogram(
            "onebit_first_byte_seconds",
            "Time from a served request's arrival to its first response byte (outcome ok or detached)",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prefill = Histogram(
            "onebit_provider_prefill_seconds",
            "A provider's own prefill time (its claim), by route and what it ran on",
            ["route", "provider", "engine", "device"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.restore = Histogram(
            "onebit_restore_seconds",
            "Time around the decoder's slot restore",
            buckets=_HANDOFF_BUCKETS,
            registry=self.registry,
        )
        self.share = Histogram(
            "onebit_share_seconds",
            "Time of the share handshake",
            buckets=_HANDOFF_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "onebit_prompt_tokens",
            "Prompt tokens of completion requests, by route",
            ["route"],
            registry=self.registry,
        )
        self.decoder_prompt_tokens = Counter(
            "onebit_decoder_prompt_tokens",
            "Prompt tokens the decoder evaluated itself (timings.prompt_n), by route",
            ["route"],
            registry=self.registry,
        )
        self.model_requests = Counter(
            "onebit_model_requests",
            "Completion requests by the model that served them, and outcome",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.load_wait = Histogram(
            "onebit_model_load_wait_seconds",
            "Time a request waited for its model to load (several models)",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_Live(snapshot))
        self._children = Children()

    def observe(self, line: RouteLine) -> None:
        children = self._children
        children(self.requests, line.route, line.outcome, line.fallback or "-").inc()
        if line.first_byte_ms is not None and line.outcome in ("ok", "detached"):
            # Served requests only: a 503 or a refusal answered in a fraction of a millisecond would
            # make latency look better the more requests are turned away.
            children(self.first_byte, line.route).observe(line.first_byte_ms / 1000)
        if line.route != "plain" and line.prefill_ms and line.outcome != "cancelled":  # a whole prefill only
            where = (line.provider or "-", line.engine or "-", line.device or "-")
            children(self.prefill, line.route, *where).observe(line.prefill_ms / 1000)
        if line.restore_ms:
            self.restore.observe(line.restore_ms / 1000)
        if line.share_ms:
            self.share.observe(line.share_ms / 1000)
        if line.prompt_tokens is not None:
            children(self.prompt_tokens, line.route).inc(line.prompt_tokens)
        if line.decoder_prompt_n is not None:
            children(self.decoder_prompt_tokens, line.route).inc(line.decoder_prompt_n)
        if line.model is not None:
            children(self.model_requests, line.model, line.outcome).inc()
            if line.load_ms is not None:
                children(self.load_wait, line.model).observe(line.load_ms / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)
