"""What the route lines add up to: counts per route and fallback, recent first-byte times, and the
live feed ``onebitctl watch`` reads.  Fed by the front with every route line, exactly once each."""

from __future__ import annotations

import statistics
from collections import Counter, deque
from collections.abc import Mapping
from typing import Any

import attrs
import trio

from ..routeline import RequestOutcome, RouteLine

# The window `onebitctl status` summarises: enough requests for a p95 to mean something.
RECENT = 200
# A watcher that cannot keep up loses lines rather than slowing requests down.
WATCH_BUFFER = 1024


@attrs.frozen
class FirstByte:
    """Arrival to first byte over the last requests that ended well (``None``: no request yet)."""

    n: int
    median_ms: float | None
    p95_ms: float | None


@attrs.frozen
class RouteStatistics:
    routes: Mapping[str, int]
    outcomes: Mapping[str, int]
    fallbacks: Mapping[str, int]
    first_byte: FirstByte
    watchers: int
    watch_dropped: int  # lines a watcher that could not keep up did not get


class RouteStats:
    def __init__(self) -> None:
        self.routes: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        self._first_byte: deque[float] = deque(maxlen=RECENT)
        self._watchers: set[trio.MemorySendChannel[dict[str, Any]]] = set()
        self.dropped = 0

    def record(self, line: RouteLine) -> None:
        self.routes[line.route] += 1
        self.outcomes[line.outcome] += 1
        if line.fallback:
            self.fallbacks[line.fallback] += 1
        if line.first_byte_ms is not None and line.outcome == RequestOutcome.OK:
            self._first_byte.append(line.first_byte_ms)
        if not self._watchers:
            return
        fields = line.fields()
        for watcher in list(self._watchers):
            try:
                watcher.send_nowait(fields)
            except trio.WouldBlock:
                self.dropped += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._watchers.discard(watcher)

    def watch(self) -> trio.MemoryReceiveChannel[dict[str, Any]]:
        """A feed of every route line from now on; close the channel to stop."""
        send, receive = trio.open_memory_channel[dict[str, Any]](WATCH_BUFFER)
        self._watchers.add(send)
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
        )
