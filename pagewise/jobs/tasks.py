"""The Celery tasks. Each is idempotent, so a redelivered one (its worker died) changes nothing twice. Each runs in
its own span (`pagewise.jobs.tracing`), to which a task adds what it is about."""

from __future__ import annotations

import datetime as dt
import logging

from opentelemetry import trace

from pagewise.jobs import exports, retention, usage_check
from pagewise.jobs.celery_app import app, settings
from pagewise.jobs.database import session_factory

logger = logging.getLogger(__name__)


def _session():
    return session_factory(settings().database_url)()


def _previous_month(today: dt.date) -> str:
    return (today.replace(day=1) - dt.timedelta(days=1)).strftime("%Y-%m")


@app.task(name="pagewise.check_usage")
def check_usage(days_ago: int = 0) -> list[str]:
    """Compare the UTC day `days_ago` days back; log and return the differences (`[]`: usage is consistent)."""
    day = dt.datetime.now(dt.UTC).date() - dt.timedelta(days=days_ago)
    with _session() as session:
        differences = usage_check.check_day(session, day)
    for line in differences:
        logger.error("usage_daily disagrees with the request rows: %s", line)
    return differences


@app.task(name="pagewise.export_month")
def export_month(tenant_id: str, period: str) -> dict[str, object]:
    """Export one tenant's month; the answer names the revision (new or unchanged)."""
    span = trace.get_current_span()
    span.set_attributes({"pagewise.tenant.id": tenant_id, "pagewise.export.period": period})
    today = dt.datetime.now(dt.UTC).date()
    with _session() as session:
        export = exports.export_month(session, settings().export_path, tenant_id, period, today)
    span.set_attributes({"pagewise.export.id": export.id, "pagewise.export.revision": export.revision})
    return {"id": export.id, "revision": export.revision, "csv_sha256": export.csv_sha256}


@app.task(name="pagewise.export_all")
def export_all(period: str | None = None) -> list[str]:
    """Queue the export of every tenant with usage in `period` (default: last month); returns their ids."""
    today = dt.datetime.now(dt.UTC).date()
    period = period or _previous_month(today)
    with _session() as session:
        tenants = exports.tenants_with_usage(session, period, today)
    for tenant_id in tenants:
        export_month.delay(tenant_id, period)
    return tenants


@app.task(name="pagewise.purge_bodies")
def purge_bodies() -> int:
    """Drop request bodies past `PAGEWISE_RETENTION_DAYS` (nothing when it is unset); returns how many."""
    days = settings().retention_days
    if days is None:
        return 0
    with _session() as session:
        return retention.purge_bodies(session, dt.datetime.now(dt.UTC), dt.timedelta(days=days))
