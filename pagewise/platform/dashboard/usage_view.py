"""A usage page (`usage.service.usage_page`) as the dashboard shows it: a stacked bar chart and a CSV file.

Tokens are input + output tokens (cached input tokens are part of the input). The chart keeps the
`MAX_SERIES - 1` largest groups by name and adds the rest up under "other", so its legend stays readable; the CSV
always has every group, one row per bucket and group.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
from collections import defaultdict
from collections.abc import Callable

from pagewise.platform.dashboard.charts import BarChart, Column, stacked_bars
from pagewise.platform.usage.service import BucketWidth, GroupField, UsagePage, UsageResult

MAX_SERIES = 8
OTHER = "other"
ALL = "all"
CSV_COLUMNS = (
    "start_time",
    "end_time",
    "tenant_id",
    "model",
    "num_model_requests",
    "input_tokens",
    "output_tokens",
    "input_cached_tokens",
)


def _group_key(result: UsageResult, group: GroupField | None) -> str:
    return ALL if group is None else str(getattr(result, group) or "")


def _bucket_label(start: int, width: BucketWidth) -> str:
    moment = dt.datetime.fromtimestamp(start, dt.UTC)
    return moment.strftime("%b %d") if width == "1d" else moment.strftime("%d %H:00")


def usage_chart(
    page: UsagePage, width: BucketWidth, group: GroupField | None, name_of: Callable[[str], str]
) -> BarChart:
    """Tokens per bucket, stacked by `group` (`None`: one series); `name_of` turns a group key into its label."""
    totals: dict[str, int] = defaultdict(int)
    for bucket in page.data:
        for result in bucket.results:
            totals[_group_key(result, group)] += result.input_tokens + result.output_tokens
    ranked = sorted(totals, key=lambda k: (-totals[k], k))
    shown = ranked if len(ranked) <= MAX_SERIES else ranked[: MAX_SERIES - 1]
    index = {key: i for i, key in enumerate(shown)}
    names = [name_of(key) for key in shown] + ([OTHER] if len(shown) < len(ranked) else []) or [ALL]
    columns = []
    for bucket in page.data:
        values = [0] * len(names)
        for result in bucket.results:
            values[index.get(_group_key(result, group), len(names) - 1)] += result.input_tokens + result.output_tokens
        columns.append(Column(_bucket_label(bucket.start_time, width), tuple(values)))
    return stacked_bars(columns, names, "tokens")


def usage_totals(page: UsagePage, group: GroupField) -> dict[str, UsageResult]:
    """`group`'s key → its results summed over every bucket of `page` (a page grouped by `group` alone)."""
    totals: dict[str, UsageResult] = {}
    for bucket in page.data:
        for r in bucket.results:
            total = totals.setdefault(_group_key(r, group), UsageResult())
            total.num_model_requests += r.num_model_requests
            total.input_tokens += r.input_tokens
            total.output_tokens += r.output_tokens
            total.input_cached_tokens += r.input_cached_tokens
            total.cost_micros += r.cost_micros
    return totals


def usage_csv(page: UsagePage) -> str:
    """One row per bucket and group, bucket bounds in ISO 8601 UTC; empty buckets are left out."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for bucket in page.data:
        start, end = (dt.datetime.fromtimestamp(t, dt.UTC).isoformat() for t in (bucket.start_time, bucket.end_time))
        for r in bucket.results:
            writer.writerow(
                (
                    start,
                    end,
                    r.tenant_id or "",
                    r.model or "",
                    r.num_model_requests,
                    r.input_tokens,
                    r.output_tokens,
                    r.input_cached_tokens,
                )
            )
    return out.getvalue()
