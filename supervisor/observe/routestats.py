"""What the route lines add up to: counts per route and fallback, recent first-byte times, and the
live feed ``onebitctl watch`` and the status page read.  Fed by the front with every route line,
exactly once each, and by the models with their own and their decoders' transitions and their
prefix stores' events (:meth:`RouteStats.publish`).

The feed is one set of subscribers, each a bounded memory channel: an event is handed to each with
``send_nowait``, so no subscriber ever slows a request.  One that is full loses the event (``onebitctl
watch``: it counts in ``watch_dropped``), or, where it asked so (the status page's feed), is closed
and told at once (``watch_closed``): a slow reader is dropped, never buffered without limit.

A line's fields go out as the route line's, but for its ``error``: redacted (supervisor/observe/
redact.py), so that no feed carries what a client sent."""

from __future__ import annotations

import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import trio

from ..routeline import RequestOutcome, RouteLine
from .redact import redact

# The window `onebitctl status` summarises: enough requests for a p95 to mean something.
RECENT = 200
# A watcher that cannot keep up loses lines rather than slowing requests down.
WATCH_BUFFER = 1024

Event = dict[str, Any]  # {"event": "line" | "child" | "model" | "store", ...}: JSON as it goes on the wire


@attrs.frozen
class FirstByte:
    """Arrival to first byte over the last requests that ended well (``None``: no request yet)."""

    n: int
    median_ms: float | None
    p95_ms: float | None


@attrs.frozen
class EstimateAccuracy:
    """How the cost decision's estimates held, for one route and engine over the last requests:
    the actual prefill (the decoder's on plain; the provider's, the handoff's and the decoder's
    last token on a hybrid route) over the estimate of the route taken (``est_plain_ms`` or
    ``est_hybrid_ms``)."""

    route: str
    engine: str  # "decoder" on plain; else the provider's engine, or its name where it has none
    n: int
    median_ratio: float  # actual / estimated: above 1, the model is optimistic
    within_1_5: float  # the share of requests whose actual was within 1.5x of the estimate, either way


def accuracy_of(line: RouteLine) -> tuple[str, str, float] | None:
    """``(route, engine, actual / estimate)`` for a request the cost decision estimated and that
    ended well, on the route it was estimated for; None otherwise."""
    if line.outcome != RequestOutcome.OK:
        return None
    if line.route == "plain":
        estimate, actual, engine = line.est_plain_ms, line.decoder_prompt_ms, "decoder"
    else:
        estimate, engine = line.est_hybrid_ms, line.engine or line.provider or "?"
        actual = line.wait_ms + line.prefill_ms + line.restore_ms + line.share_ms + (line.decoder_prompt_ms or 0.0)
    if estimate is None or actual is None or estimate <= 0 or actual <= 0:
        return None
    return line.route, engine, actual / estimate


def summarize(ratios: Iterable[tuple[str, str, float]]) -> tuple[EstimateAccuracy, ...]:
    """Per route and engine, the median ratio of actual to estimate and the share within 1.5x."""
    groups: dict[tuple[str, str], list[float]] = {}
    for route, engine, ratio in ratios:
        groups.setdefault((route, engine), []).append(ratio)
    return tuple(
        EstimateAccuracy(
            route=route,
            engine=engine,
            n=len(values),
            median_ratio=round(statistics.median(values), 3),
            within_1_5=round(sum(1 for v in values if 1 / 1.5 <= v <= 1.5) / len(values), 3),
        )
        for (route, engine), values in sorted(groups.items())
    )


@attrs.frozen
class RouteStatistics:
    routes: Mapping[str, int]
    outcomes: Mapping[str, int]
    fallbacks: Mapping[str, int]
    first_byte: FirstByte
    watchers: int
    watch_dropped: int  # lines a watcher that could not keep up did not get
    watch_closed: int  # watchers closed because they could not keep up (the status page's feeds)
    estimates: tuple[EstimateAccuracy, ...] = ()  # the cost decision's estimates against actuals


@attrs.frozen(eq=False)  # each one itself: hashed by identity
class _Watcher:
    send: trio.MemorySendChannel[Event]
    on_full: Callable[[], None] | None  # None: lose the event; else close the watcher and call this


class RouteStats:
    def __init__(self) -> None:
        self.routes: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        self._first_byte: deque[float] = deque(maxlen=RECENT)
        self._recent: deque[tuple[float, RouteLine]] = deque(maxlen=RECENT)  # the last lines, and when
        self._estimates: deque[tuple[str, str, float]] = deque(maxlen=RECENT)  # route, engine, actual/est
        self._watchers: set[_Watcher] = set()
        self.dropped = 0
        self.closed = 0

    def record(self, line: RouteLine) -> None:
        self.routes[line.route] += 1
        self.outcomes[line.outcome] += 1
        if line.fallback:
            self.fallbacks[line.fallback] += 1
        if line.first_byte_ms is not None and line.outcome == RequestOutcome.OK:
            self._first_byte.append(line.first_byte_ms)
        if (ratio := accuracy_of(line)) is not None:
            self._estimates.append(ratio)
        # Kept as it is (a line is not written to after its end): its fields are made only for a
        # watcher, so a daemon nobody watches pays a deque append a request.
        at = time.time()
        self._recent.append((at, line))
        if self._watchers:
            self.publish({"event": "line", "at": round(at, 3), "line": shown(line)})

    def recent(self) -> list[Event]:
        """The last :data:`RECENT` route lines, ``{"at", "line"}`` (``at``: its end, wall-clock
        seconds), oldest first: what a new status page shows."""
        return [{"at": round(at, 3), "line": shown(line)} for at, line in self._recent]

    def publish(self, event: Event) -> None:
        """Hand ``event`` to every watcher now, without waiting for any."""
        for watcher in list(self._watchers):
            try:
                watcher.send.send_nowait(event)
            except trio.WouldBlock:
                if watcher.on_full is None:
                    self.dropped += 1
                else:
                    self._watchers.discard(watcher)
                    watcher.send.close()
                    self.closed += 1
                    watcher.on_full()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._watchers.discard(watcher)

    def watch(
        self, bound: int = WATCH_BUFFER, *, on_full: Callable[[], None] | None = None
    ) -> trio.MemoryReceiveChannel[Event]:
        """A feed of every event from now on, at most ``bound`` of them waiting; close the channel
        to stop.  ``on_full``: a full feed is closed and this called (else it loses the event)."""
        send, receive = trio.open_memory_channel[Event](bound)
        self._watchers.add(_Watcher(send, on_full))
        return receive

    def first_byte(self) -> FirstByte:
        times = sorted(self._first_byte)
        if not times:
            return FirstByte(n=0, median_ms=None, p95_ms=None)
        p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
        return FirstByte(n=len(times), median_ms=statistics.median(times), p95_ms=p95)

    def snapshot(self) -> RouteStatistics:
        return RouteStatistics(
            routes=dict(self.routes),
            outcomes=dict(self.outcomes),
            fallbacks=dict(self.fallbacks),
            first_byte=self.first_byte(),
            watchers=len(self._watchers),
            watch_dropped=self.dropped,
            watch_closed=self.closed,
            estimates=summarize(self._estimates),
        )


def shown(line: RouteLine) -> dict[str, Any]:
    """A route line's fields as the feed sends them: its ``error`` redacted."""
    fields = line.fields()
    if line.error is not None:
        fields["error"] = redact(line.error)
    return fields
