"""The state a provider hands over, measured against the decoder's own state for the same tokens, and
the bound it must stay within at start.

The next-token distance (supervisor/routes/fidelity.py) cannot see a wrong state where the logits
barely move with it (the tiny random-weight models: near-uniform distributions whatever they hold).
The state itself can be compared whatever the weights: the start-time check saves the slot right
after the file route's restore (the provider's state for the handed tokens) and after the decoder's
own prefill of exactly those tokens, and :func:`compare_files` measures the one against the other
with supervisor/llama/statediff.py: each tensor's ``||a - b|| / ||b||`` per layer, and where the
cells differ.

    ok  <=>  no cell differs  and  every compared tensor's error <= STATE_BOUND

Which parts, and what they cost (pure Python, run off the trio thread): the recurrent parts (R, the
convolution state; S, the SSM or delta-net state; one cell per sequence, a few hundred KB) on every
prompt of the check, since a provider's state may be wrong on any of them (Granite 4's mamba2 S on
OpenVINO: all zeros on each gate prompt; after them, 50 times the decoder's norm); the KV caches'
values on the first prompt only, the check's cost growing with them.  Measured on the shared 2-CPU
VM: SmolLM2-135M's first gate prompt (about 90 tokens), both files read and compared in 0.4-0.8 s
of a gate of about 60 s; the cells alone (SmolLM2) or the recurrent parts (a tiny hybrid model) in
at most 0.07 s a prompt.  Where the decoder's own state cannot be read (a cache type the reader
does not decode) nothing is compared, and the summary says so; where only the provider's cannot,
it is refused.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from ..llama import statediff, statefile

# The bound (docs/reliability.md, "State proof", for the measurement): OpenVINO's states are within
# 2e-4 of the decoder's on the tiny models and 0.05 on SmolLM2's V (its own kernels and rounding); a
# state one position off is at least 0.23 away.
STATE_BOUND = 0.1


@attrs.frozen
class StateCheck:
    """One prompt's handed-over state against the decoder's own: the worst tensor's error, and where
    the cells differ (tokens, a part's positions)."""

    error: float  # the worst compared tensor's relative error; 0.0 where none was compared
    tensor: str  # that tensor's kind, "K", "V", "R" or "S" ("" where none was compared)
    differences: tuple[str, ...] = ()
    kv: bool = False  # the KV caches' values were compared too
    seconds: float = 0.0  # what reading and comparing took
    unread: str | None = None  # why the decoder's own state could not be read: nothing compared

    @property
    def compared(self) -> bool:
        return self.unread is None and bool(self.tensor)

    @property
    def ok(self) -> bool:
        return self.unread is not None or (not self.differences and self.error <= STATE_BOUND)

    def words(self) -> str:
        """Why it is over the bound (``state S off by 49 (bound 0.1)``), or its figure."""
        if self.unread is not None:
            return f"state not compared: {self.unread}"
        if self.differences:
            return f"state cells differ: {'; '.join(self.differences)}"
        if not self.tensor:
            return "state: nothing compared"
        if not self.ok:
            return f"state {self.tensor} off by {self.error:.3g} (bound {STATE_BOUND:g})"
        return f"state: worst {self.tensor} {self.error:.3g} (bound {STATE_BOUND:g})"


def compare_files(provided: Path, own: Path, *, kv: bool) -> StateCheck:
    """``provided`` (the provider's state, restored and saved) against ``own`` (the decoder's, of the
    same tokens); ``kv``: the KV caches' values too, not only the recurrent parts.  Synchronous and
    CPU-bound: run it in a thread."""
    started = time.perf_counter()
    try:
        reference = statefile.read(own, kv_values=kv)
    except (OSError, statefile.StateFileError) as exc:
        return StateCheck(0.0, "", kv=kv, seconds=time.perf_counter() - started, unread=str(exc))
    try:
        comparison = statediff.compare(statefile.read(provided, kv_values=kv), reference, kv=kv)
    except (OSError, statefile.StateFileError) as exc:
        # The decoder's own state reads and the provider's, restored without complaint, does not.
        return StateCheck(math.inf, "", (f"the provider's state: {exc}",), kv, time.perf_counter() - started)
    worst = max(comparison.errors, key=lambda e: e.error, default=None)
    return StateCheck(
        worst.error if worst is not None else 0.0,
        worst.tensor if worst is not None else "",
        comparison.differences,
        kv,
        time.perf_counter() - started,
    )


def worst(checks: Sequence[StateCheck]) -> StateCheck | None:
    """The check that decides: the first over the bound, else the largest error; None where none ran."""
    if not checks:
        return None
    failed = [c for c in checks if not c.ok]
    if failed:
        return max(failed, key=lambda c: c.error)
    return max(checks, key=lambda c: c.error)


def summary(checks: Sequence[StateCheck]) -> str:
    """The checks in one line: the worst, then each prompt's error and what it compared."""
    decider = worst(checks)
    if decider is None:
        return "state not compared"

    def one(c: StateCheck) -> str:
        if c.unread is not None:
            return "-"
        parts = "KV+R/S" if c.kv else "R/S"
        figure = f"{c.tensor} {c.error:.2g}" if c.tensor else "none"
        return f"{figure} ({parts}, {c.seconds:.2f}s)"

    return f"{decider.words()}; per prompt: {', '.join(one(c) for c in checks)}"
