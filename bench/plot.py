"""The benchmarks' figures as one SVG picture: ``scripts/bench SUBCOMMAND --plot FILE.svg``.

Each subcommand keeps its samples as it measures; it hands them here as panels, one per figure,
and says nothing about drawing.  Four kinds of panel cover what the benchmarks measure:

    XY            points against a number (first token against prompt tokens, per route; first
                  token per turn, per side), the samples as dots and a line through each x's median
    Distribution  one sample set per series as an empirical CDF (the relay's latencies, direct
                  against onebitd): where the median and the tail lie, every sample drawn
    Bars          grouped bars, a bar a series' median in its group and its samples as dots on it
                  (swap-back against warm and cold; a ratio table that no axis fits)

matplotlib (the ``bench`` extra, pinned in constraints.txt) draws them off-screen (Agg, no
display), imported only when a picture is asked for: a benchmark runs without it.  The SVG is kept
as stable as matplotlib allows, so that a re-run changes in git only where a figure did: a fixed
hash salt for its element ids, no date in its metadata, text kept as text (``svg.fonttype``
``none``: smaller, and the series' names can be read back out of it, as tests/unit/bench/test_bench.py does).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

# Two panels a row: a figure of four reads on one screen; six stay legible on a page.
COLUMNS = 2
PANEL_INCHES = (6.4, 4.2)
STYLE: dict[RcKeyType, Any] = {
    "svg.hashsalt": "onebit-bench",  # element ids from a fixed salt, not a fresh uuid per run
    "svg.fonttype": "none",  # text as <text>, not glyph paths
    "font.size": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
}


class PlotError(Exception):
    """No picture can be written (matplotlib missing, a path that cannot be): a set-up problem."""


@attrs.frozen
class XY:
    """Samples against a number: ``series`` maps a name to its (x, y) points."""

    title: str
    x_label: str
    y_label: str
    series: Mapping[str, Sequence[tuple[float, float]]]
    marks: Sequence[tuple[float, str]] = ()  # vertical lines: (x, what happened there)
    integer_x: bool = False  # turns, requests: whole-number ticks
    log_y: bool = False


@attrs.frozen
class Distribution:
    """``series`` maps a name to its samples, drawn as the fraction of samples at or below each value."""

    title: str
    x_label: str
    series: Mapping[str, Sequence[float]]
    log_x: bool = False


@attrs.frozen
class Bars:
    """``groups`` maps a group (a bar's place on the x axis) to its series' samples."""

    title: str
    y_label: str
    groups: Mapping[str, Mapping[str, Sequence[float]]]
    reference: float | None = None  # a horizontal line: 1.0 on a ratio's chart
    log_y: bool = False


Panel = XY | Distribution | Bars


def svg_path(text: str) -> Path:
    """``--plot``'s argument: an ``.svg`` in a folder that exists, checked before any measuring."""
    path = Path(text)
    if path.suffix != ".svg":
        raise argparse.ArgumentTypeError(f"--plot {text}: the picture is an SVG, FILE.svg")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"--plot {text}: no folder {path.parent}")
    return path


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plot", type=svg_path, metavar="FILE.svg", help="also draw the figures, as one SVG picture (matplotlib)"
    )


def check() -> None:
    """Raise :class:`PlotError` now, before a run of minutes, where no picture could be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError(
            "--plot needs matplotlib, the benchmark extra: run scripts/setup (or pip install -e '.[bench]')"
        ) from None


def write(path: Path, title: str, panels: Sequence[Panel], *, quick: bool, columns: int = COLUMNS) -> None:
    """``panels`` as one SVG at ``path``, ``title`` above them with the day of the run and, for a
    ``--quick`` one, that its figures are a handful of samples."""
    check()
    import matplotlib

    matplotlib.use("Agg")  # no display: the picture is a file
    from matplotlib.figure import Figure

    rows = -(-len(panels) // columns)
    columns = min(columns, len(panels))
    note = time.strftime("%Y-%m-%d", time.gmtime()) + (", --quick: a handful of samples, not figures" if quick else "")
    with matplotlib.rc_context(STYLE):
        figure = Figure(figsize=(PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows + 0.6), layout="constrained")
        figure.suptitle(f"{title}\n{note}", fontsize=10)
        axes = figure.subplots(rows, columns, squeeze=False).flatten()
        for ax, panel in zip(axes, panels, strict=False):
            DRAW[type(panel)](ax, panel)
        for ax in axes[len(panels) :]:
            ax.set_visible(False)
        figure.savefig(path, format="svg", metadata={"Date": None})


def _xy(ax: Any, panel: XY) -> None:
    for index, (name, points) in enumerate(panel.series.items()):
        color = f"C{index}"
        xs = [x for x, _ in points]
        ys = [y for _, y in points]
        ax.plot(xs, ys, "o", color=color, alpha=0.45, markersize=4)
        line = sorted({x: statistics.median(y for px, y in points if px == x) for x in xs}.items())
        ax.plot([x for x, _ in line], [y for _, y in line], "-", color=color, label=name)
    for x, what in panel.marks:
        ax.axvline(x, color="0.4", linestyle="--", linewidth=1)
        ax.annotate(what, (x, 1), xycoords=("data", "axes fraction"), xytext=(3, -12), textcoords="offset points")
    if panel.integer_x:
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if panel.log_y:
        _log(ax, "y")
    _label(ax, panel.title, panel.x_label, panel.y_label)


def _distribution(ax: Any, panel: Distribution) -> None:
    for name, samples in panel.series.items():
        if not samples:
            continue  # a side that measured nothing: no line (its median would not exist)
        ordered = sorted(samples)
        fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
        median = statistics.median(ordered)
        shown = f"{median:.0f}" if median >= 100 else f"{median:.3g}"  # 1370, not 1.37e+03
        ax.step(ordered, fractions, where="post", label=f"{name} (median {shown})")
    ax.axhline(0.5, color="0.6", linewidth=0.8)
    ax.set_ylim(0, 1.02)
    if panel.log_x:
        _log(ax, "x")
    _label(ax, panel.title, panel.x_label, "fraction of samples at or below")


def _bars(ax: Any, panel: Bars) -> None:
    groups = list(panel.groups)
    names = list(dict.fromkeys(name for series in panel.groups.values() for name in series))
    width = 0.8 / max(1, len(names))
    for index, name in enumerate(names):
        color = f"C{index}"
        offset = (index - (len(names) - 1) / 2) * width
        places, medians, dots = [], [], []
        for place, group in enumerate(groups):
            samples = panel.groups[group].get(name, ())
            if samples:
                places.append(place + offset)
                medians.append(statistics.median(samples))
                dots += [(place + offset, value) for value in samples]
        ax.bar(places, medians, width * 0.9, color=color, alpha=0.7, label=name)
        ax.plot([x for x, _ in dots], [y for _, y in dots], ".", color="0.15", markersize=3)
    if panel.reference is not None:
        ax.axhline(panel.reference, color="0.3", linestyle="--", linewidth=1)
    turned = len(groups) > 4  # long model names side by side overlap
    ax.set_xticks(range(len(groups)), groups, rotation=30 if turned else 0, ha="right" if turned else "center")
    if panel.log_y:
        _log(ax, "y")
    _label(ax, panel.title, "", panel.y_label)


def _log(ax: Any, which: str) -> None:
    """A log scale on axis ``which`` ("x", "y"), labelled in plain numbers (20, 30, 1000), not
    matplotlib's 2x10^1 mathtext."""
    from matplotlib.ticker import LogFormatter

    getattr(ax, f"set_{which}scale")("log")
    axis = getattr(ax, f"{which}axis")
    axis.set_major_formatter(LogFormatter(labelOnlyBase=False))
    axis.set_minor_formatter(LogFormatter(labelOnlyBase=False))


def _label(ax: Any, title: str, x_label: str, y_label: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.legend(fontsize=8)


DRAW: dict[type[Any], Any] = {XY: _xy, Distribution: _distribution, Bars: _bars}
