"""A worker killed (SIGKILL) in the middle of a monthly export still yields exactly one export: one revision, its
files whole with the hashes it records, reconciling to the micro-dollar with the request rows.

Two ways to die: the pool process running the export (the worker sends the task again, at once), and the whole
worker (the broker hands the unacknowledged task to the next worker once the visibility timeout has passed; the
test moves the broker's record of the delivery back past it instead of waiting an hour). Each test runs workers of
its own, under a key prefix of its own, and seeds a month of ~60,000 usage rows in bulk so that the export runs
for seconds: it is seen `STARTED` (the result names the process running it), killed, and found not to have
written its row before the next worker runs it.
"""

from __future__ import annotations

import csv
import datetime as dt
import hashlib
import io
import os
import secrets
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult
from sqlalchemy import delete, func, select, text
from sqlalchemy.orm import Session

from pagewise.jobs.celery_app import celery_config
from pagewise.jobs.database import session_factory
from pagewise.platform.billing.export_files import export_paths
from pagewise.platform.db.ids import new_id
from pagewise.platform.db.models import ApiKey, BillingExport, RequestRecord, Tenant
from pagewise.platform.settings import Settings

from ..conftest import REDIS_URL
from .conftest import drop_keys, start_worker, stop_worker, worker_env

_THIS_MONTH = dt.datetime.now(dt.UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
MONTH = (_THIS_MONTH - dt.timedelta(days=1)).replace(day=1)  # last month: over
PERIOD = MONTH.strftime("%Y-%m")
MODELS = 1000  # × 2 keys × the month's days: one request row and one usage row each


@dataclass(slots=True)
class Broker:
    """A worker environment of this test's own, and a Celery client on its broker."""

    env: dict[str, str]
    prefix: str
    export_dir: Path
    client: Celery
    visibility_timeout_s: int

    def result(self, task_id: str) -> AsyncResult:
        return self.client.AsyncResult(task_id)


@pytest.fixture
def broker(jobs_database: str, tmp_path: Path) -> Iterator[Broker]:
    prefix = f"pagewise_test_{secrets.token_hex(6)}:"
    env = worker_env(jobs_database, prefix, tmp_path / "exports")
    settings = Settings.from_env(env)
    client = Celery("pagewise-test-client", set_as_current=False)
    client.conf.update(celery_config(settings))
    try:
        yield Broker(env, prefix, tmp_path / "exports", client, settings.jobs_visibility_timeout_s)
    finally:
        client.close()
        drop_keys(prefix)


@pytest.fixture
def tenant_month(jobs_database: str) -> Iterator[str]:
    """A tenant with a month of usage: 2 keys × `MODELS` models × every day of `MONTH`, one settled request each,
    and `usage_daily` as settlement leaves it (the rows' sums per day, model and key). Deleted afterwards."""
    tenant_id = new_id("ten")
    with session_factory(jobs_database)() as session, session.begin():
        session.add(Tenant(id=tenant_id, name=f"kill-{secrets.token_hex(4)}", status="active"))
        session.flush()
        keys = {"tenant": tenant_id, "a": new_id("key"), "b": new_id("key")}
        session.add_all(
            ApiKey(id=keys[k], tenant_id=tenant_id, prefix=secrets.token_hex(6), secret_sha256="0" * 64, scopes=[])
            for k in ("a", "b")
        )
        session.flush()
        session.execute(
            text(
                """
                INSERT INTO requests (id, tenant_id, api_key_id, endpoint, model, input, params, status,
                                      prompt_tokens, completion_tokens, cached_tokens, cost_micros,
                                      queued_at, started_at, first_token_at, finished_at)
                SELECT 'cmpl_' || md5(concat_ws(':', k, m, d)), :tenant, k, 'completions', 'm-' || m, '{}',
                       '{}', 'completed', p, c, p / 3, (p - p / 3) * 2 + (p / 3) + c * 8, t, t, t, t
                FROM unnest(ARRAY[:a, :b]) AS k, generate_series(1, :models) AS m,
                     generate_series(0, :days - 1) AS d,
                     LATERAL (SELECT (m * 7 + d) % 3000 + 1 AS p, (m * 13 + d) % 500 AS c,
                                     CAST(:first AS timestamptz) + make_interval(days => d, hours => m % 24) AS t) AS v
                """
            ),
            {**keys, "models": MODELS, "days": _days(MONTH), "first": MONTH},
        )
        session.execute(
            text(
                """
                INSERT INTO usage_daily (tenant_id, day, model, api_key_id, requests, prompt_tokens,
                                         completion_tokens, cached_tokens, cost_micros)
                SELECT tenant_id, CAST(finished_at AT TIME ZONE 'UTC' AS date), model, api_key_id, count(*),
                       sum(prompt_tokens), sum(completion_tokens), sum(cached_tokens), sum(cost_micros)
                FROM requests WHERE tenant_id = :tenant GROUP BY 1, 2, 3, 4
                """
            ),
            keys,
        )
    try:
        yield tenant_id
    finally:
        with session_factory(jobs_database)() as session, session.begin():
            session.execute(delete(Tenant).where(Tenant.id == tenant_id))


def _days(month: dt.datetime) -> int:
    return ((month + dt.timedelta(days=32)).replace(day=1) - month).days


def _exports(session: Session, tenant_id: str) -> list[BillingExport]:
    query = select(BillingExport).where(BillingExport.tenant_id == tenant_id, BillingExport.period == PERIOD)
    return list(session.scalars(query))


def _started(result: AsyncResult, timeout_s: float = 120) -> int:
    """The pid of the process running the task, once it is `STARTED`."""
    deadline = time.monotonic() + timeout_s
    while result.state != "STARTED":
        assert result.state == "PENDING" and time.monotonic() < deadline, result.state
        time.sleep(0.02)
    return int(result.info["pid"])


def _assert_exactly_one_export(database_url: str, broker: Broker, tenant_id: str, answer: dict) -> None:
    with session_factory(database_url)() as session:
        exports = _exports(session, tenant_id)
        totals = session.execute(
            select(
                func.count(),
                func.sum(RequestRecord.prompt_tokens),
                func.sum(RequestRecord.cached_tokens),
                func.sum(RequestRecord.completion_tokens),
                func.sum(RequestRecord.cost_micros),
            ).where(RequestRecord.tenant_id == tenant_id)
        ).one()
    assert [(e.revision, e.id, e.csv_sha256) for e in exports] == [(1, answer["id"], answer["csv_sha256"])]
    export = exports[0]
    csv_path, jsonl_path = export_paths(broker.export_dir, export)
    assert sorted(os.listdir(csv_path.parent)) == ["r1.csv", "r1.jsonl"]  # no partial file left behind
    csv_bytes, jsonl_bytes = csv_path.read_bytes(), jsonl_path.read_bytes()
    assert hashlib.sha256(csv_bytes).hexdigest() == export.csv_sha256
    assert hashlib.sha256(jsonl_bytes).hexdigest() == export.jsonl_sha256
    records = list(csv.DictReader(io.StringIO(csv_bytes.decode())))
    usage, total = records[:-1], records[-1]
    count, prompt, cached, completion, cost = map(int, totals)
    assert len(usage) == export.num_rows == 2 * MODELS * _days(MONTH) == count
    assert total["kind"] == "total" and all(r["kind"] == "usage" for r in usage)
    columns = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_micros")
    assert tuple(int(total[c]) for c in columns) == (count, prompt, cached, completion, cost)
    assert sum(int(r["cost_micros"]) for r in usage) == cost == export.total_cost_micros
    assert total["cost_usd"] == f"{cost // 10**6}.{cost % 10**6:06d}"  # exact to the micro-dollar, so to the cent
    assert len(jsonl_bytes.splitlines()) == len(records)


def test_a_killed_pool_process_yields_exactly_one_export(
    broker: Broker, tenant_month: str, jobs_database: str
) -> None:
    worker = start_worker(broker.env)
    try:
        result = broker.result(broker.client.send_task("pagewise.export_month", args=[tenant_month, PERIOD]).id)
        pool_process = _started(result)
        assert pool_process != worker.pid
        os.kill(pool_process, signal.SIGKILL)
        with session_factory(jobs_database)() as session:
            assert _exports(session, tenant_month) == []  # killed mid-export: no revision yet
        answer = result.get(timeout=180)  # the worker sends it again; a new pool process runs it
        assert worker.poll() is None  # the worker itself lived on
    finally:
        stop_worker(worker)
    _assert_exactly_one_export(jobs_database, broker, tenant_month, answer)


def test_a_killed_worker_yields_exactly_one_export_from_the_next_worker(
    broker: Broker, tenant_month: str, jobs_database: str
) -> None:
    first = start_worker(broker.env)
    try:
        result = broker.result(broker.client.send_task("pagewise.export_month", args=[tenant_month, PERIOD]).id)
        _started(result)
        os.killpg(first.pid, signal.SIGKILL)  # the worker and its pool process, no shutdown of any kind
        first.wait()
    finally:
        stop_worker(first)
    with session_factory(jobs_database)() as session:
        assert _exports(session, tenant_month) == []
    assert result.state == "STARTED"  # nobody is left to say otherwise

    # The broker hands the message out again once `visibility_timeout_s` has passed since its delivery: record
    # that delivery as that long ago (kombu's index of unacknowledged messages is scored by delivery time).
    client = redis.Redis.from_url(REDIS_URL)
    try:
        unacked = client.zrange(f"{broker.prefix}unacked_index", 0, -1)
        assert len(unacked) == 1
        client.zadd(f"{broker.prefix}unacked_index", {unacked[0]: time.time() - broker.visibility_timeout_s - 1})
    finally:
        client.close()
    second = start_worker(broker.env)
    try:
        answer = result.get(timeout=180)
    finally:
        stop_worker(second)
    _assert_exactly_one_export(jobs_database, broker, tenant_month, answer)
