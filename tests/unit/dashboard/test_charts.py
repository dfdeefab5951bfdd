"""Chart geometry: one scale, bottom-up stacking in series order, no zero segments, bounded labels."""

from __future__ import annotations

import pytest

from pagewise.platform.dashboard.charts import BOTTOM, HEIGHT, MAX_X_LABELS, TOP, Column, round_up, stacked_bars


@pytest.mark.parametrize(("value", "top"), [(0, 1), (1, 1), (2, 2), (3, 5), (5, 5), (7, 10), (120, 200), (1000, 1000)])
def test_round_up_to_one_two_or_five(value: int, top: int) -> None:
    assert round_up(value) == top


def test_segments_stack_on_one_scale() -> None:
    chart = stacked_bars([Column("a", (3, 1)), Column("b", (0, 4))], ["x", "y"], "tokens")
    plot = HEIGHT - TOP - BOTTOM
    assert chart.bottom == TOP + plot and chart.total == 8
    a_x, a_y, b_y = chart.segments  # b's zero "x" value draws nothing
    assert (a_x.series, a_y.series, b_y.series) == (0, 1, 1)
    assert a_x.height == pytest.approx(3 / 5 * plot) and a_x.y == pytest.approx(chart.bottom - a_x.height)
    assert a_y.y + a_y.height == pytest.approx(a_x.y)  # stacked right on top of the first segment
    assert b_y.height == pytest.approx(4 / 5 * plot) and b_y.x > a_x.x
    assert [t.text for t in chart.y_ticks] == ["0", "5"]  # no half tick: 2.5 is no whole number
    assert a_x.title == "a · x: 3 tokens"


def test_labels_stay_few_and_an_empty_chart_still_draws() -> None:
    chart = stacked_bars([Column(str(i), (0,)) for i in range(168)], ["all"], "tokens")
    assert len(chart.x_labels) <= MAX_X_LABELS and chart.x_labels[0].text == "0"
    assert (chart.segments, chart.total, [t.text for t in chart.y_ticks]) == ([], 0, ["0", "1"])


def test_a_column_without_a_value_per_series_is_refused() -> None:
    with pytest.raises(ValueError, match="one value per series"):
        stacked_bars([Column("a", (1,))], ["x", "y"], "tokens")
