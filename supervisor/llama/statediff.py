"""One slot state file measured against another: every part's every layer, relative error.

:func:`compare` measures a state (supervisor/llama/statefile.py reads it) against a reference part by
part, layer by layer: K and V of each KV cache over the cells at the positions both hold, R and S of
a recurrent memory cell by cell in order (a sequence's recurrent state is one cell, at its last
token).  It says where the cells differ (the tokens, a part's positions), so that a state one
position off shows whatever its values; :func:`layer_errors` is the first KV cache alone.  The
state proof of every family's handoff rests on it (tests/real/test_real_state_fidelity.py,
docs/reliability.md); ``scripts/slotdiff A.state B.state`` prints it.
"""

from __future__ import annotations

import array
import math
from collections.abc import Sequence
from pathlib import Path

import attrs

from .statefile import KvCache, SlotState, StateFileError, read


@attrs.frozen
class LayerError:
    layer: int
    k: float  # ||K_a - K_b|| / ||K_b|| over the compared cells
    v: float


@attrs.frozen
class TensorError:
    """One layer's one tensor of a part, measured: ``||a - b|| / ||b||`` over the compared cells."""

    part: str  # a KvCache's name, or "recurrent"
    layer: int  # the layer's index among the part's own
    tensor: str  # "K", "V", "R" or "S"
    error: float


@attrs.frozen
class Comparison:
    """One state file measured against a reference: every tensor's error, and where the cells differ."""

    errors: tuple[TensorError, ...]
    differences: tuple[str, ...]  # empty when both hold the same tokens in cells at the same positions

    @property
    def max_error(self) -> float:
        return max((e.error for e in self.errors), default=0.0)

    def worst(self, tensor: str) -> float:
        """The largest error of one kind of tensor ("K", "V", "R", "S"); 0 where there is none."""
        return max((e.error for e in self.errors if e.tensor == tensor), default=0.0)


def relative_error(a: Sequence[float], b: Sequence[float]) -> float:
    """``||a - b|| / ||b||`` (0 when both are all zeros, inf when only ``b`` is)."""
    diff = math.fsum((x - y) * (x - y) for x, y in zip(a, b, strict=True))
    norm = math.fsum(y * y for y in b)
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return math.sqrt(diff / norm)


def layer_errors(a: SlotState, b: SlotState) -> list[LayerError]:
    """Each layer's relative K and V error of ``a``'s first KV cache against ``b``'s (the reference),
    over the cells at the positions both hold; raises :class:`StateFileError` when they cannot be
    compared."""
    if not a.caches or not b.caches:
        raise StateFileError("no KV cache to compare")
    errors = _kv_errors(a.caches[0], b.caches[0])
    return [LayerError(n, k.error, v.error) for n, (k, v) in enumerate(zip(errors[0::2], errors[1::2], strict=True))]


def compare(a: SlotState, b: SlotState, *, kv: bool = True) -> Comparison:
    """``a`` measured against ``b`` (the reference), part by part; raises :class:`StateFileError` when
    they are not states of one model's memory.  A KV cache's cells are matched by position, over the
    positions both hold; a recurrent memory's in order.  Where the tokens, a part's positions or its
    cell count differ, ``differences`` says so: a state one position off shows there, whatever its
    values.  ``kv`` false: the KV caches' cells are checked but their values not measured (the
    costly part; a recurrent memory is one cell a sequence)."""
    if [c.name for c in a.caches] != [c.name for c in b.caches] or (a.recurrent is None) != (b.recurrent is None):
        raise StateFileError(f"{_parts(a)} against {_parts(b)}: not the same memory")
    differences = [] if a.tokens == b.tokens else [f"tokens: {len(a.tokens)} against {len(b.tokens)}, not the same"]
    errors: list[TensorError] = []
    for ca, cb in zip(a.caches, b.caches, strict=True):
        if ca.positions != cb.positions:
            differences.append(f"{ca.name}: cells at {_span(ca.positions)} against {_span(cb.positions)}")
        if kv:
            errors += _kv_errors(ca, cb)
    if a.recurrent is not None and b.recurrent is not None:
        ra, rb = a.recurrent, b.recurrent
        if ra.positions != rb.positions:
            differences.append(f"recurrent: cells at {_span(ra.positions)} against {_span(rb.positions)}")
        if len(ra.r) != len(rb.r) or len(ra.positions) != len(rb.positions):
            raise StateFileError(
                f"recurrent: {len(ra.r)} layers of {len(ra.positions)} cells against {len(rb.r)} of {len(rb.positions)}"
            )
        for tensor, rows_a, rows_b in (("R", ra.r, rb.r), ("S", ra.s, rb.s)):
            for n, (x, y) in enumerate(zip(rows_a, rows_b, strict=True)):
                if x.width != y.width:
                    raise StateFileError(f"recurrent layer {n}: {tensor} rows of {x.width} against {y.width}")
                errors.append(TensorError("recurrent", n, tensor, relative_error(x.values, y.values)))
    return Comparison(tuple(errors), tuple(differences))


def _parts(state: SlotState) -> str:
    return " + ".join([c.name for c in state.caches] + (["recurrent"] if state.recurrent is not None else []))


def _span(positions: tuple[int, ...]) -> str:
    if not positions:
        return "none"
    return f"{positions[0]}..{positions[-1]} ({len(positions)})"


def _kv_errors(a: KvCache, b: KvCache) -> list[TensorError]:
    """K then V of each layer, over the cells at the positions both caches hold."""
    if len(a.layers) != len(b.layers):
        raise StateFileError(f"{a.name}: {len(a.layers)} layers against {len(b.layers)}: not the same model")
    cell_of_b = {pos: i for i, pos in enumerate(b.positions)}
    pairs = [(i, cell_of_b[pos]) for i, pos in enumerate(a.positions) if pos in cell_of_b]
    if not pairs:
        raise StateFileError(f"{a.name}: no position in common")
    errors = []
    for n, (la, lb) in enumerate(zip(a.layers, b.layers, strict=True)):
        if (la.k_width, la.v_width) != (lb.k_width, lb.v_width):
            raise StateFileError(
                f"{a.name} layer {n}: rows of {la.k_width}/{la.v_width} against {lb.k_width}/{lb.v_width}"
            )
        errors.append(TensorError(a.name, n, "K", _rows_error(la.k, lb.k, la.k_width, pairs)))
        errors.append(TensorError(a.name, n, "V", _rows_error(la.v, lb.v, la.v_width, pairs)))
    return errors


def _rows_error(a: array.array[float], b: array.array[float], width: int, pairs: list[tuple[int, int]]) -> float:
    if all(i == j for i, j in pairs) and len(pairs) * width == len(a) == len(b):
        return relative_error(a, b)
    picked_a = array.array("f")
    picked_b = array.array("f")
    for i, j in pairs:
        picked_a.extend(a[i * width : (i + 1) * width])
        picked_b.extend(b[j * width : (j + 1) * width])
    return relative_error(picked_a, picked_b)


def main(argv: Sequence[str] | None = None) -> int:
    """``scripts/slotdiff A.state B.state``: each layer's relative error of A against B, part by part
    (K and V of each KV cache, R and S of a recurrent memory), and where their cells differ."""
    import argparse

    parser = argparse.ArgumentParser(prog="slotdiff", description=main.__doc__)
    parser.add_argument("a", type=Path, help="the slot state file to measure")
    parser.add_argument("b", type=Path, help="the reference slot state file")
    args = parser.parse_args(argv)
    try:
        a, b = read(args.a), read(args.b)
        comparison = compare(a, b)
    except (OSError, StateFileError) as exc:
        print(f"slotdiff: {exc}")
        return 2
    common = len(set(a.positions) & set(b.positions))
    print(
        f"{a.n_cells} cells against {b.n_cells}, {common} positions compared; "
        f"tokens {'equal' if a.tokens == b.tokens else 'differ'}"
    )
    parts = [(c.name, "K", "V") for c in a.caches] + ([("recurrent", "R", "S")] if a.recurrent else [])
    for n, (part, first, second) in enumerate(parts):
        by_layer: dict[int, dict[str, float]] = {}
        for e in comparison.errors:
            if e.part == part:
                by_layer.setdefault(e.layer, {})[e.tensor] = e.error
        print(("" if n == 0 else f"{part}: ") + f"layer  {first} rel err  {second} rel err")
        for layer, errs in by_layer.items():
            print(f"{layer:5d}  {errs[first]:9.5f}  {errs[second]:9.5f}")
        worst = [max(errs[t] for errs in by_layer.values()) for t in (first, second)]
        print(f"  max  {worst[0]:9.5f}  {worst[1]:9.5f}")
    for difference in comparison.differences:
        print(f"differ: {difference}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
