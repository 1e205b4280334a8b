"""What prefill and handoffs cost here, learnt from the children's own reports.

A prefill's cost, per child (the decoder, each provider), is modelled as

    ms = fixed + per_token x n_new + context x n_new x (n_cached + n_new / 2)

``n_new`` the tokens it evaluates, ``n_cached`` those its cache already held: the last term is
attention, whose work per token grows with the context before it.  The terms are fitted by least
squares with non-negative coefficients (each child's last :data:`WINDOW` prefills of at least
:data:`FLOOR` tokens, relative errors, one pass that drops outliers); ``fixed`` is the median of what
the fitted terms leave over, short prefills included.  A short prefill is mostly fixed cost (the
batch it joins, the streams it is interleaved with) and says little about the per-token rate.

An estimate says whether it is sure: the fitted terms are used only for a size that prefills within
:data:`NEAR` x of it were measured at (at least :data:`SURE_SAMPLES` of them); otherwise the
configured prior rate stands in, scaled by the speed the fits show (a loaded machine slows both
sides: :meth:`Rates.prefill`), and the estimate is unsure.  Where the other side's fit holds at
that size, the stand-in follows its curve (its context term too), scaled to this side's rate: the
two sides are compared on one shape, not one side's curve against the other's straight line.
Short prefills make no fit: a rate from 30-token prefills is never extrapolated to 8,000.

A handoff (a save and a restore, or a share) costs ``fixed + per_MiB x MiB`` of state, fitted the
same way.  Every fit is forgotten when the child it describes restarts (a new process may run on
other cores or with other flags); providers without a child generation are one population.
"""

from __future__ import annotations

import itertools
import statistics
import sys
from collections import deque
from collections.abc import Sequence

import attrs

from .slowdown import DECODING, OVERLAP_MS, SHARED, Shared, Slowdown

# Prefills kept per child for the fit: enough to span several sizes, few enough to follow the load.
WINDOW = 48
# Short prefills kept for the fixed cost (every request behind a handoff adds a 1-token one).
SHORT_WINDOW = 16
# A prefill of fewer tokens is mostly fixed cost and joins only the fixed cost's estimate: at the
# few ms a token of a CPU, 64 tokens are a few hundred ms, the size of the fixed costs seen under load.
FLOOR = 64
# The fitted terms hold for sizes within this factor of measured ones.
NEAR = 4.0
# Measured prefills within NEAR of the size asked for before the fit is trusted there.
SURE_SAMPLES = 2
# A sample whose relative error is beyond this many times the median's is dropped before the refit.
OUTLIER = 3.0
MIB = 1 << 20


@attrs.frozen
class PrefillTiming:
    """One prefill as measured: the tokens it evaluated, those its cache held, and its time."""

    n_new: int
    n_cached: int
    ms: float


def _context(n_new: int, n_cached: int) -> float:
    return n_new * (n_cached + n_new / 2)


@attrs.frozen
class PrefillCost:
    """One child's prefill cost as fitted now: a value an estimate is made from."""

    prior_ms_per_token: float  # stands in where the fit is not trusted (scaled, see Rates.prefill)
    fixed_ms: float = 0.0
    ms_per_token: float | None = None  # None: no fit
    ms_per_context: float = 0.0  # per token evaluated and token of context before it
    sizes: tuple[int, ...] = ()  # the sizes of the prefills the fit is from
    everywhere: bool = False  # the terms hold at every size (a cost given, not fitted)
    # The other side's fit, whose curve stands in for the prior where this fit does not hold and
    # that one does, scaled to the prior's rate (Rates.prefill sets it).
    shape: PrefillCost | None = None

    def sure(self, n_new: int) -> bool:
        """Whether the fitted terms hold at ``n_new`` tokens: enough prefills near that size."""
        if self.ms_per_token is None:
            return False
        near = sum(1 for n in self.sizes if n / NEAR <= max(1, n_new) <= n * NEAR)
        return self.everywhere or near >= SURE_SAMPLES

    def ms(self, n_new: int, n_cached: int = 0) -> float:
        """The estimated time to prefill ``n_new`` tokens after ``n_cached``."""
        if self.ms_per_token is not None and self.sure(n_new):  # mypy: sure() checks it too
            return self.fixed_ms + self._variable(n_new, n_cached)
        shape = self.shape
        if shape is not None and shape.sure(n_new) and shape.rate > 0:
            return self.fixed_ms + self.prior_ms_per_token / shape.rate * shape._variable(n_new, n_cached)
        return self.fixed_ms + self.prior_ms_per_token * n_new

    def _variable(self, n_new: int, n_cached: int) -> float:
        """The fitted terms that grow with the prompt: all but the fixed cost."""
        return (self.ms_per_token or 0.0) * n_new + self.ms_per_context * _context(n_new, n_cached)

    @property
    def rate(self) -> float:
        """Its per-token cost where it was measured: the fit's at the middle of its sizes (context
        term included), else the prior."""
        if self.ms_per_token is None or not self.sizes:
            return self.prior_ms_per_token
        n = statistics.median(self.sizes)
        return self.ms_per_token + self.ms_per_context * n / 2


def linear(ms_per_token: float) -> PrefillCost:
    """A cost that is ``ms_per_token`` a token at every size, and sure of it (a test's, a tool's)."""
    return PrefillCost(ms_per_token, ms_per_token=ms_per_token, everywhere=True)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(b)
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-12 * max(1.0, max(abs(v) for row in m for v in row[:n])):
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[r][n] / m[r][r] for r in range(n)]


def nnls(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Least squares of relative error (``|row . x - y| / y``) with every coefficient >= 0.

    Exact for the few columns here: every subset of the columns is solved unconstrained, and the
    feasible one with the least error wins (the sparser on a tie, the order of the columns breaking
    the rest)."""
    k = len(rows[0])
    best: tuple[float, list[float]] = (float("inf"), [0.0] * k)
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            # Each row scaled by 1/y: the squared error is relative.
            scaled = [([row[c] / y for c in cols], 1.0) for row, y in zip(rows, ys, strict=True)]
            normal = [[sum(r[i] * r[j] for r, _ in scaled) for j in range(size)] for i in range(size)]
            rhs = [sum(r[i] * t for r, t in scaled) for i in range(size)]
            x = _solve(normal, rhs)
            if x is None or min(x) < 0:
                continue
            err = sum((sum(r[i] * x[i] for i in range(size)) - t) ** 2 for r, t in scaled)
            if err < best[0] * (1 - 1e-9) - 1e-12:
                full = [0.0] * k
                for c, v in zip(cols, x, strict=True):
                    full[c] = v
                best = (err, full)
    return best[1]


def _robust(rows: list[list[float]], ys: list[float]) -> list[float]:
    """:func:`nnls`, then again without the samples far off the first fit (one prefill that waited
    behind a burst of decoding must not set the rate)."""
    x = nnls(rows, ys)
    errors = [abs(sum(r * c for r, c in zip(row, x, strict=True)) - y) / y for row, y in zip(rows, ys, strict=True)]
    limit = OUTLIER * statistics.median(errors)
    kept = [i for i, e in enumerate(errors) if e <= limit or e <= 0.05]
    if len(rows) > 3 and len(kept) < len(rows):
        x = nnls([rows[i] for i in kept], [ys[i] for i in kept])
    return x


@attrs.define
class Prefills:
    """One child's recent prefills, and the fit of them (kept until the next sample)."""

    prior: float
    generation: int = -1
    long: deque[PrefillTiming] = attrs.Factory(lambda: deque(maxlen=WINDOW))
    short: deque[PrefillTiming] = attrs.Factory(lambda: deque(maxlen=SHORT_WINDOW))
    _fit: PrefillCost | None = None

    def observe(self, sample: PrefillTiming, generation: int) -> None:
        if generation != self.generation:
            self.generation = generation
            self.long.clear()
            self.short.clear()
        (self.long if sample.n_new >= FLOOR else self.short).append(sample)
        self._fit = None

    @property
    def samples(self) -> int:
        return len(self.long) + len(self.short)

    def measured(self, generation: int) -> bool:
        return generation == self.generation and bool(self.long)

    def cost(self, generation: int) -> PrefillCost:
        """The fit for ``generation`` (the prior alone where it has no samples)."""
        if generation != self.generation or not self.samples:
            return PrefillCost(self.prior)
        if self._fit is None:
            self._fit = self._fitted()
        return self._fit

    def _fitted(self) -> PrefillCost:
        per_token, context = self.prior, 0.0
        if self.long:
            ys = [max(s.ms, 1e-3) for s in self.long]
            spans = [s.n_new + s.n_cached for s in self.long]
            # The context term (attention's growth) only from prefills that span a range of lengths
            # (NEAR x): from one size, or a few close ones, a curve fits as well as a line and would
            # extrapolate quadratically.  And never instead of the per-token term: a fit whose
            # per-token term came out 0 is refitted as a line.
            if max(spans) >= NEAR * min(spans):
                rows = [[s.n_new, _context(s.n_new, s.n_cached), 1.0] for s in self.long]
                per_token, context, _ = _robust(rows, ys)
            if context == 0.0 or per_token <= 0.0:
                per_token, _ = _robust([[s.n_new, 1.0] for s in self.long], ys)
                context = 0.0
        left = [s.ms - per_token * s.n_new - context * _context(s.n_new, s.n_cached) for s in (*self.long, *self.short)]
        fixed = max(0.0, statistics.median(left))
        if not self.long:
            return PrefillCost(self.prior, fixed_ms=fixed)
        sizes = tuple(s.n_new for s in self.long)
        return PrefillCost(self.prior, fixed, per_token, context, sizes)


@attrs.define
class Handoffs:
    """Recent handoffs (state moved, ms), fitted as ``fixed + per_MiB x MiB``."""

    prior_ms_per_mib: float
    window: deque[tuple[float, float]] = attrs.Factory(lambda: deque(maxlen=WINDOW))

    def observe(self, mib: float, ms: float) -> None:
        self.window.append((mib, ms))

    def fit(self) -> tuple[float, float]:
        """``(fixed_ms, ms_per_mib)``: the prior per MiB alone until a handoff was measured."""
        if not self.window:
            return 0.0, self.prior_ms_per_mib
        per_mib, fixed = _robust([[mib, 1.0] for mib, _ in self.window], [max(ms, 1e-3) for _, ms in self.window])
        return fixed, per_mib


@attrs.frozen
class RateStatistics:
    """What the cost decision believes now (``onebitctl status``'s costs line): each child's
    per-token prefill rate where measured (its prior where not), a handoff's cost per MiB of state,
    and the slowdowns on shared cores with the prefills each was measured from (0: the prior)."""

    decoder_ms_per_token: float
    providers_ms_per_token: dict[str, float]
    handoff_ms_per_mib: float
    state_bytes_per_token: float
    shared: float = SHARED
    shared_samples: int = 0
    decode: float = DECODING
    decode_samples: int = 0


class Rates:
    def __init__(
        self,
        *,
        decoder_ms_per_token: float,
        provider_ms_per_token: float,
        handoff_ms_per_mib: float,
        state_bytes_per_token: float,
    ) -> None:
        self.decoder = Prefills(decoder_ms_per_token)
        self._provider_prior = provider_ms_per_token
        self.providers: dict[str, Prefills] = {}
        self.handoff = Handoffs(handoff_ms_per_mib)
        self.state_bytes_per_token = state_bytes_per_token
        # How much the other child's prefill slows a child's on shared cores, and the decoder's
        # replies decoding a provider's.
        self.slowdown = Slowdown(SHARED)
        self.decode_slowdown = Slowdown(DECODING)

    def provider(self, name: str) -> Prefills:
        return self.providers.setdefault(name, Prefills(self._provider_prior))

    def prefill(self, generation: int, provider: str) -> tuple[PrefillCost, PrefillCost]:
        """The decoder's and ``provider``'s prefill costs, for comparing them.

        Where a side's fit does not hold at a size, its prior stands in, scaled by what the fits
        show of this machine's speed: a side with a fit by its own fitted rate over its prior, a
        side without one by the other side's.  A loaded or slow machine slows both, and a measured
        rate against a bare prior would make whichever side was measured first look the slower.
        Where the other side's fit holds, the stand-in takes its curve (:attr:`PrefillCost.shape`):
        a straight line at the rate of the other side's middle size would make that side, its
        context term counted, look the slower above that size and the faster below it."""
        decoder, other = self.decoder, self.provider(provider)
        d, p = decoder.cost(generation), other.cost(0)
        d_speed = d.rate / decoder.prior if decoder.measured(generation) else None
        p_speed = p.rate / other.prior if other.measured(0) else None
        d_scale = d_speed if d_speed is not None else p_speed if p_speed is not None else 1.0
        p_scale = p_speed if p_speed is not None else d_speed if d_speed is not None else 1.0
        return (
            attrs.evolve(d, prior_ms_per_token=decoder.prior * d_scale, shape=p),
            attrs.evolve(p, prior_ms_per_token=other.prior * p_scale, shape=d),
        )

    def decoder_ms_per_token(self, generation: int) -> float:
        """The decoder's per-token term (the prefix store weighs a restore against it)."""
        return self.decoder.cost(generation).rate

    def observe_decoder(
        self, generation: int, prompt_n: int | None, prompt_ms: float | None, cache_n: int | None = None
    ) -> None:
        if prompt_n is not None and prompt_ms is not None and prompt_n > 0:
            self.decoder.observe(PrefillTiming(prompt_n, cache_n or 0, prompt_ms), generation)

    def observe_provider(
        self, name: str, evaluated: int | None, prefill_ms: float | None, cached: int | None = None
    ) -> None:
        # Providers without a child generation (exec) are one population; 0 stands for it.
        if evaluated is not None and prefill_ms is not None and evaluated > 0:
            self.provider(name).observe(PrefillTiming(evaluated, cached or 0, prefill_ms), 0)

    def shared(self) -> Shared:
        """The slowdowns on shared cores now (routes/decision.py's ``Costs.shared``)."""
        return Shared(self.slowdown.factor, self.decode_slowdown.factor)

    def observe_shared(self, sample: tuple[float, float, float, float] | None) -> None:
        """A prefill that ran beside the other child's work on shared cores: ``(its estimate alone,
        its overlap with the other child's prefills, with the decoder's replies decoding, its actual
        ms)`` (routes/story.py's ``Story.shared_sample``).  A sample that overlapped only one kind
        says what that kind costs (less than :data:`OVERLAP_MS` of the other is none); one that
        overlapped both cannot tell them apart and is left."""
        if sample is None:
            return
        alone, prefills, decoding, actual = sample
        if decoding < OVERLAP_MS:
            self.slowdown.observe(alone, prefills, actual)
        elif prefills < OVERLAP_MS:
            self.decode_slowdown.observe(alone, decoding, actual)

    def observe_handoff(self, n_tokens: int, state_bytes: int | None, handoff_ms: float | None) -> None:
        if state_bytes is None or handoff_ms is None or state_bytes <= 0 or n_tokens <= 0:
            return
        self.handoff.observe(state_bytes / MIB, handoff_ms)
        # A model's state per token is fixed: the last handoff's figure is the figure.
        self.state_bytes_per_token = state_bytes / n_tokens

    def handoff_ms(self, n_tokens: int) -> float:
        """The estimated cost of moving ``n_tokens`` tokens' state from a provider to the decoder."""
        fixed, per_mib = self.handoff.fit()
        return fixed + per_mib * n_tokens * self.state_bytes_per_token / MIB

    def tokens_in(self, mib: int) -> int:
        """The tokens whose state ``mib`` MiB hold (-1: no bound; a prompt cache's size in tokens)."""
        return sys.maxsize if mib < 0 else mib * MIB // max(1, round(self.state_bytes_per_token))

    def restore_ms(self, state_bytes: int) -> float:
        """The estimated cost of restoring ``state_bytes`` of state (a stored prefix)."""
        fixed, per_mib = self.handoff.fit()
        return fixed + per_mib * state_bytes / MIB

    def statistics(self, generation: int) -> RateStatistics:
        return RateStatistics(
            decoder_ms_per_token=self.decoder.cost(generation).rate,
            providers_ms_per_token={name: p.cost(0).rate for name, p in self.providers.items()},
            handoff_ms_per_mib=self.handoff.fit()[1],
            state_bytes_per_token=self.state_bytes_per_token,
            shared=self.slowdown.factor,
            shared_samples=len(self.slowdown.window),
            decode=self.decode_slowdown.factor,
            decode_samples=len(self.decode_slowdown.window),
        )
