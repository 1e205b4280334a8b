"""How much each child's work slows the other's prefill where the two share cores, learnt from the
prefills that ran beside it (routes/decision.py's ``estimate`` adds it; ``Rates`` owns the two
figures and is told each sample by routes/story.py's ``Story.shared_sample``).

Two llama.cpp processes whose threads outnumber the cores slow each other by far more than their
share of the work: a thread that waits at a barrier for one descheduled holds the whole step back.
No constant fits every machine, so each figure is measured, with a prior until it is.
"""

from __future__ import annotations

import statistics
from collections import deque

import attrs

# On shared cores, the share of the other child's prefill that slows one child's while both run, before
# any is measured (then Slowdown's): two prefills that each take every core they share run at half
# speed at best, which is 0.5 of the overlap where this one outlasts the other's (1 where the other
# outlasts it).  Measured on the fleet workload: on one 2-core VM (AVX2) two decoder continuations
# beside a provider's prefill took 16% and 24% longer than alone; on a 2-core Zen 4 VM 30 to 60
# token continuations beside an OpenVINO prefill took 2.2x to 2.7x the estimate alone.
SHARED = 0.5
# On shared cores, the share of the decoder's replies being decoded that slows a provider's prefill
# while they decode, before any is measured (then Slowdown's): 1 is two jobs taking turns at the
# cores, each at half speed.  Measured on a 2-core Zen 4 VM: one reply decoding beside an OpenVINO
# provider's 800-token prefill made it 3.4x as long (2.4 of the overlap), where a decoder's prefill of
# the same size beside it made it 2.0x (1.0): a decode step is short, and llama.cpp's threads wait
# at its barriers for one the provider's threads keep off a core.
DECODING = 1.0
# A prefill whose estimate overlapped the other child's work by less than this says little of the slowdown.
OVERLAP_MS = 50.0
# Slowdowns measured before the measured one replaces the prior, and the most one may say.
SHARED_SAMPLES = 3
SHARED_MAX = 3.0
# Slowdown samples kept: the median of the last this many is the figure.
WINDOW = 48


@attrs.define
class Slowdown:
    """How much one kind of the other child's work slows a prefill on shared cores: each sample is
    ``(actual - alone) / overlap`` of one prefill (its estimate without the other child's work, and
    how long that work overlapped it); the median of the last :data:`WINDOW`, else the prior.  The
    prefills' figure serves both sides: the two contend for the same cores with the same kind of
    work, and a figure learnt for one side alone would make the other look the cheaper for as long
    as it was not measured (every request sent there, which loads the cores more)."""

    prior: float
    window: deque[float] = attrs.Factory(lambda: deque(maxlen=WINDOW))

    def observe(self, alone_ms: float, overlap_ms: float, actual_ms: float) -> None:
        if overlap_ms >= OVERLAP_MS and actual_ms > 0:
            self.window.append(min(SHARED_MAX, max(0.0, (actual_ms - alone_ms) / overlap_ms)))

    @property
    def factor(self) -> float:
        return statistics.median(self.window) if len(self.window) >= SHARED_SAMPLES else self.prior


@attrs.frozen
class Shared:
    """On shared cores, how much of the time the other child's work overlaps a prefill it adds to
    it: the other child's prefill (``prefill``, either side), or the decoder's replies being decoded
    beside a provider's prefill (``decode``).  Two figures: a reply decoding slowed an OpenVINO
    provider's prefill more than twice as much as a prefill of its own size did (:data:`DECODING`)."""

    prefill: float = SHARED
    decode: float = DECODING
