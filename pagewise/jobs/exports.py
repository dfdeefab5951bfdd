"""Monthly billing exports: one CSV and one JSONL file per revision of a (tenant, period).

Invariants:
- The files are a pure function of the tenant's `usage_daily` rows of the month (the source of truth): one row
  per key × model × day, sorted, then one `total` row. Nothing else (no clock, no id) goes into them, so a
  rerun on unchanged usage gives byte-identical files.
- Idempotent per (tenant, period, content): when a revision of the period has the files' hashes, that revision is
  the answer and nothing is written; otherwise the next revision is written — files first, row last. A month's
  usage only grows, so its contents never repeat and the matching revision is always the latest.
- A file is whole or absent: written to a partial file, flushed to disk, renamed over its name (and the folder
  flushed). A job killed before its commit leaves at most files and no row; its rerun computes the same revision
  and writes the same bytes, then the row. Killed after its commit, its rerun finds the revision and writes
  nothing.
- Exports of one tenant are serialized by a row lock on the tenant (`FOR NO KEY UPDATE`: settlements adding the
  tenant's usage meanwhile are not blocked; on SQLite, the database's write lock), so two runs never race for a
  revision or write each other's files.
"""

from __future__ import annotations

import csv
import datetime as dt
import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from pagewise.platform.billing.export_files import ExportError, export_paths, month_bounds
from pagewise.platform.db.ids import new_id
from pagewise.platform.db.models import BillingExport, Tenant, UsageDaily
from pagewise.platform.db.session import sqlite_write_lock
from pagewise.serving.money import format_dollars

COLUMNS = (
    "kind",
    "tenant_id",
    "period",
    "api_key_id",
    "batch_id",
    "model",
    "day",
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "cost_micros",
    "cost_usd",
)
_TOTALS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_micros")


@dataclass(frozen=True, slots=True)
class ExportFiles:
    csv: bytes
    jsonl: bytes

    @property
    def hashes(self) -> tuple[str, str]:
        return hashlib.sha256(self.csv).hexdigest(), hashlib.sha256(self.jsonl).hexdigest()


def _records(tenant_id: str, period: str, usage: list[UsageDaily]) -> list[dict[str, object]]:
    """The export's records: usage rows (already sorted), then the totals."""
    records: list[dict[str, object]] = [
        {
            "kind": "usage",
            "tenant_id": tenant_id,
            "period": period,
            "api_key_id": u.api_key_id,
            "batch_id": u.batch_id,
            "model": u.model,
            "day": u.day.isoformat(),
            "requests": u.requests,
            "prompt_tokens": u.prompt_tokens,
            "cached_tokens": u.cached_tokens,
            "completion_tokens": u.completion_tokens,
            "cost_micros": u.cost_micros,
            "cost_usd": format_dollars(u.cost_micros),
        }
        for u in usage
    ]
    totals = {k: sum(int(r[k]) for r in records) for k in _TOTALS}  # type: ignore[call-overload]
    records.append(
        {
            "kind": "total",
            "tenant_id": tenant_id,
            "period": period,
            "api_key_id": "",
            "batch_id": "",
            "model": "",
            "day": "",
            **totals,
            "cost_usd": format_dollars(totals["cost_micros"]),
        }
    )
    return records


def render(tenant_id: str, period: str, usage: list[UsageDaily]) -> ExportFiles:
    """The CSV and JSONL bytes for `usage` (sorted by key, model, day)."""
    records = _records(tenant_id, period, usage)
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(records)
    jsonl = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
    return ExportFiles(text.getvalue().encode(), jsonl.encode())


def _write_atomically(path: Path, content: bytes) -> None:
    """`path` holds `content` whole, on disk, or is left as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    with partial.open("wb") as file:
        file.write(content)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself
    finally:
        os.close(folder)


def export_month(session: Session, export_dir: Path, tenant_id: str, period: str, today: dt.date) -> BillingExport:
    """The export of `tenant_id`'s usage in `period`: the revision with this content if there is one, else a new
    revision. Commits; raises `ExportError` (and changes nothing) for an unknown tenant or a bad period."""
    first, following = month_bounds(period, today)
    with session.begin():
        if (lock := sqlite_write_lock(session)) is not None:
            session.execute(lock)
        tenant = session.scalar(select(Tenant).where(Tenant.id == tenant_id).with_for_update(key_share=True))
        if tenant is None:
            raise ExportError(f"no tenant with id {tenant_id!r}")
        usage = list(
            session.scalars(
                select(UsageDaily)
                .where(UsageDaily.tenant_id == tenant_id, UsageDaily.day >= first, UsageDaily.day < following)
                .order_by(UsageDaily.api_key_id, UsageDaily.batch_id, UsageDaily.model, UsageDaily.day)
            )
        )
        files = render(tenant_id, period, usage)
        csv_sha256, jsonl_sha256 = files.hashes
        of_period = (BillingExport.tenant_id == tenant_id, BillingExport.period == period)
        same = session.scalar(
            select(BillingExport).where(
                *of_period, BillingExport.csv_sha256 == csv_sha256, BillingExport.jsonl_sha256 == jsonl_sha256
            )
        )
        if same is not None:
            return same
        latest = session.scalar(select(func.max(BillingExport.revision)).where(*of_period))
        export = BillingExport(
            id=new_id("exp"),
            tenant_id=tenant_id,
            period=period,
            revision=(latest or 0) + 1,
            num_rows=len(usage),
            total_cost_micros=sum(u.cost_micros for u in usage),
            csv_sha256=csv_sha256,
            jsonl_sha256=jsonl_sha256,
        )
        csv_path, jsonl_path = export_paths(export_dir, export)
        _write_atomically(csv_path, files.csv)
        _write_atomically(jsonl_path, files.jsonl)
        session.add(export)
    return export


def tenants_with_usage(session: Session, period: str, today: dt.date) -> list[str]:
    """The tenants that have usage in `period` (the monthly job exports each)."""
    first, following = month_bounds(period, today)
    query = (
        select(UsageDaily.tenant_id)
        .where(UsageDaily.day >= first, UsageDaily.day < following)
        .distinct()
        .order_by(UsageDaily.tenant_id)
    )
    return list(session.scalars(query))
