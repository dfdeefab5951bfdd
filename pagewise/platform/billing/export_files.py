"""What the API and the jobs agree on about billing exports: which months can be exported, and where a revision's
files live under the export folder (a folder every replica and jobs worker mounts)."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

from pagewise.platform.db.models import BillingExport

PERIOD = re.compile(r"(\d{4})-(0[1-9]|1[0-2])")


class ExportError(ValueError):
    """A request for an export that cannot exist (unknown tenant, malformed or future period)."""


def month_bounds(period: str, today: dt.date) -> tuple[dt.date, dt.date]:
    """First day of `period` (`YYYY-MM`) and of the month after; an `ExportError` unless it has begun."""
    match = PERIOD.fullmatch(period)
    if match is None:
        raise ExportError(f"period must be a month as YYYY-MM; got {period!r}")
    first = dt.date(int(match.group(1)), int(match.group(2)), 1)
    if first > today:
        raise ExportError(f"period {period} has not begun yet")
    following = (first + dt.timedelta(days=32)).replace(day=1)
    return first, following


def export_paths(export_dir: Path, export: BillingExport) -> tuple[Path, Path]:
    """Where a revision's CSV and JSONL files live."""
    base = export_dir / export.tenant_id / export.period / f"r{export.revision}"
    return base.with_suffix(".csv"), base.with_suffix(".jsonl")
