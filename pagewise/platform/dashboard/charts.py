"""Stacked bar charts as plain geometry, which `templates/_macros.html` draws as inline SVG (no script, no library).

Invariants: one linear scale for the whole chart, from 0 to a round number at or above the largest column total,
so heights compare across columns; a column's segments stack bottom-up in series order; a zero value draws no
segment; at most `MAX_X_LABELS` column labels are written, evenly spaced, so they never overlap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

WIDTH, HEIGHT = 1160, 260  # about the page's width: text in the SVG then shows near its own size
LEFT, RIGHT, TOP, BOTTOM = 64, 32, 10, 28  # margins around the plot: axis labels live there
MAX_X_LABELS = 12
GAP = 0.2  # the share of a column's slot left empty between bars


@dataclass(frozen=True, slots=True)
class Column:
    label: str
    values: tuple[int, ...]  # one per series


@dataclass(frozen=True, slots=True)
class Segment:
    x: float
    y: float
    width: float
    height: float
    series: int
    title: str  # the tooltip: column, series and value


@dataclass(frozen=True, slots=True)
class Tick:
    position: float  # x for column labels, y for value ticks
    text: str


@dataclass(frozen=True, slots=True)
class BarChart:
    width: int
    height: int
    left: int
    bottom: float  # y of the baseline
    segments: list[Segment]
    x_labels: list[Tick]
    y_ticks: list[Tick]
    series: list[str]
    total: int  # the sum of every value: 0 means an empty chart


def round_up(value: int) -> int:
    """The smallest of 1, 2, 5 × 10^k at or above `value` (1 for 0): a scale top that reads well."""
    if value <= 1:
        return 1
    magnitude = 10 ** math.floor(math.log10(value))
    return next(step * magnitude for step in (1, 2, 5, 10) if step * magnitude >= value)


def stacked_bars(columns: Sequence[Column], series: Sequence[str], unit: str) -> BarChart:
    """The chart of `columns` (each with one value per name in `series`); `unit` names the values in tooltips."""
    if any(len(c.values) != len(series) for c in columns):
        raise ValueError("every column needs exactly one value per series")
    top = round_up(max((sum(c.values) for c in columns), default=0))
    plot_width, plot_height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    bottom = TOP + plot_height
    slot = plot_width / max(len(columns), 1)
    segments = []
    for i, column in enumerate(columns):
        base = bottom
        for s, value in enumerate(column.values):
            if value <= 0:
                continue
            height = value / top * plot_height
            base -= height
            title = f"{column.label} · {series[s]}: {value:,} {unit}"
            segments.append(Segment(LEFT + i * slot + slot * GAP / 2, base, slot * (1 - GAP), height, s, title))
    every = math.ceil(len(columns) / MAX_X_LABELS) or 1
    x_labels = [Tick(LEFT + (i + 0.5) * slot, c.label) for i, c in enumerate(columns) if i % every == 0]
    fractions = (0, 0.5, 1) if top % 2 == 0 else (0, 1)  # a middle tick only where it is a whole number
    y_ticks = [Tick(bottom - f * plot_height, f"{top * f:,.0f}") for f in fractions]
    return BarChart(
        WIDTH, HEIGHT, LEFT, bottom, segments, x_labels, y_ticks, list(series), sum(sum(c.values) for c in columns)
    )
