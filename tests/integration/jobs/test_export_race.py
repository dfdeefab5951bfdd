"""Two exports of one tenant's month at the same moment on SQLite, which ignores the row lock PostgreSQL takes:
the second waits for the first's commit and finds its revision, instead of computing the same revision number,
writing the same files and failing on the unique revision."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pagewise.jobs import exports
from pagewise.jobs.database import session_factory
from pagewise.platform.db.ids import new_id
from pagewise.platform.db.migrate import upgrade_head
from pagewise.platform.db.models import ApiKey, BillingExport, Tenant, UsageDaily

PERIOD_START = dt.date(2026, 9, 1)


def _seed(url: str) -> str:
    tenant = Tenant(id=new_id("ten"), name="race", status="active")
    key = ApiKey(id=new_id("key"), tenant_id=tenant.id, prefix="abc123", secret_sha256="0" * 64, scopes=["inference"])
    usage = UsageDaily(
        tenant_id=tenant.id, api_key_id=key.id, model="m", day=PERIOD_START, requests=3, prompt_tokens=30,
        completion_tokens=12, cached_tokens=0, cost_micros=1_234,
    )
    with session_factory(url)() as session, session.begin():
        session.add(tenant)
        session.flush()
        session.add(key)
        session.flush()
        session.add(usage)
    return tenant.id


def test_concurrent_exports_on_sqlite_give_one_revision(
    fresh_database: Callable[[str], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = fresh_database("sqlite")
    upgrade_head(url)
    tenant_id = _seed(url)
    arrived = [threading.Event(), threading.Event()]
    index = threading.local()
    render = exports.render

    def render_together(*args: object) -> exports.ExportFiles:
        """Each run, once it has read the month, waits (up to 1 s) for the other to have read it too: without a
        lock both then decide on the same state."""
        arrived[index.me].set()
        arrived[1 - index.me].wait(timeout=1.0)
        return render(*args)

    monkeypatch.setattr(exports, "render", render_together)

    def run(me: int) -> BillingExport:
        index.me = me
        with session_factory(url)() as session:
            return exports.export_month(session, tmp_path, tenant_id, PERIOD_START.strftime("%Y-%m"), dt.date.today())

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(run, range(2))
    assert (first.id, first.revision) == (second.id, second.revision) == (first.id, 1)
    assert sorted(p.name for p in (tmp_path / tenant_id / PERIOD_START.strftime("%Y-%m")).iterdir()) == [
        "r1.csv", "r1.jsonl"
    ]
