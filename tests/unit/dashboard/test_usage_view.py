"""A usage page as a chart (largest groups named, the rest as "other") and as CSV (every group)."""

from __future__ import annotations

import csv
import io

from pagewise.platform.dashboard.usage_view import MAX_SERIES, OTHER, usage_chart, usage_csv
from pagewise.platform.usage.service import UsageBucket, UsagePage, UsageResult

DAY = 86400
START = 1_800_000_000 // DAY * DAY


def _page(results_per_bucket: list[list[UsageResult]]) -> UsagePage:
    return UsagePage(
        data=[
            UsageBucket(start_time=START + i * DAY, end_time=START + (i + 1) * DAY, results=results)
            for i, results in enumerate(results_per_bucket)
        ]
    )


def test_groups_beyond_the_legend_add_up_under_other() -> None:
    tenants = [UsageResult(tenant_id=f"t{i}", input_tokens=10 * (i + 1), output_tokens=1) for i in range(10)]
    chart = usage_chart(_page([tenants, []]), "1d", "tenant_id", lambda key: f"name-{key}")
    assert len(chart.series) == MAX_SERIES and chart.series[-1] == OTHER
    assert chart.series[0] == "name-t9"  # largest first
    assert chart.total == sum(r.input_tokens + r.output_tokens for r in tenants)
    other = [s for s in chart.segments if s.series == MAX_SERIES - 1]
    assert [s.title for s in other] == [f"Jan 15 · other: {11 + 21 + 31:,} tokens"]  # t0, t1, t2


def test_no_usage_is_one_empty_series() -> None:
    chart = usage_chart(_page([[], []]), "1h", None, str)
    assert (chart.series, chart.total, len(chart.x_labels)) == (["all"], 0, 2)


def test_csv_has_a_row_per_bucket_and_group() -> None:
    result = UsageResult(
        tenant_id="t1", model="m", num_model_requests=2, input_tokens=5, output_tokens=3, input_cached_tokens=1
    )
    rows = list(csv.DictReader(io.StringIO(usage_csv(_page([[result], []])))))
    assert rows == [
        {
            "start_time": "2027-01-15T00:00:00+00:00",
            "end_time": "2027-01-16T00:00:00+00:00",
            "tenant_id": "t1",
            "model": "m",
            "num_model_requests": "2",
            "input_tokens": "5",
            "output_tokens": "3",
            "input_cached_tokens": "1",
        }
    ]
