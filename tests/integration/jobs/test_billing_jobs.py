"""Billing jobs on a real worker: a month's export reconciles exactly with the rows it sums, a rerun is
byte-identical, a request settled afterwards yields a new revision; retention keeps usage and cost; the usage
check finds `usage_daily` in step with the rows."""

from __future__ import annotations

import asyncio
import csv
import datetime as dt
import hashlib
import io
import json
import random
import secrets

from sqlalchemy import func, select

from pagewise.platform.billing.export_files import export_paths
from pagewise.platform.db.database import Database
from pagewise.platform.db.ids import new_id
from pagewise.platform.db.models import ApiKey, BillingExport, ModelPrice, RequestRecord, Tenant
from pagewise.platform.db.session import create_db_engine
from pagewise.platform.requests.store import RequestStore
from pagewise.serving.ledgers import FinishedRequest

from .conftest import Jobs

_THIS_MONTH = dt.datetime.now(dt.UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
MONTH = (_THIS_MONTH - dt.timedelta(days=45)).replace(day=1)  # the month before last: over, and past retention
PERIOD = MONTH.strftime("%Y-%m")
DAYS = ((MONTH + dt.timedelta(days=32)).replace(day=1) - MONTH).days


def _db(url: str, work) -> object:
    async def go() -> object:
        database = Database(create_db_engine(url))
        try:
            return await work(database)
        finally:
            await database.dispose()

    return asyncio.run(go())


async def _seed(database: Database, num_requests: int) -> tuple[str, list[str], list[str]]:
    """A tenant with three keys and two priced models, and `num_requests` requests settled across `MONTH`."""
    rng = random.Random(7)
    tenant = Tenant(id=new_id("ten"), name=f"jobs-{secrets.token_hex(4)}", status="active")
    keys = [
        ApiKey(
            id=new_id("key"),
            tenant_id=tenant.id,
            prefix=secrets.token_hex(6),
            secret_sha256="0" * 64,
            scopes=["inference"],
        )
        for _ in range(3)
    ]
    models = [f"m-{secrets.token_hex(3)}" for _ in range(2)]
    async with database.sessionmaker() as session:
        session.add(tenant)
        await session.flush()
        session.add_all(keys)
        for i, model in enumerate(models):
            session.add(
                ModelPrice(
                    id=new_id("price"),
                    model=model,
                    input_per_mtok_micros=150_000 * (i + 1),
                    cached_input_per_mtok_micros=75_000,
                    output_per_mtok_micros=600_000 * (i + 1),
                    effective_from=MONTH - dt.timedelta(days=1),
                )
            )
        await session.commit()
    store = RequestStore(database)
    for _ in range(num_requests):
        at = MONTH + dt.timedelta(seconds=rng.randrange(DAYS * 86400))
        await _request(store, tenant.id, rng.choice(keys).id, rng.choice(models), at, rng)
    return tenant.id, [k.id for k in keys], models


async def _request(
    store: RequestStore, tenant_id: str, key_id: str, model: str, at: dt.datetime, rng: random.Random
) -> None:
    row = RequestRecord(
        id=new_id("cmpl"),
        tenant_id=tenant_id,
        api_key_id=key_id,
        endpoint="completions",
        model=model,
        input={"prompt": "hi"},
        params={},
        status="queued",
        queued_at=at,
    )
    await store.create(row)
    prompt = rng.randrange(1, 3000)
    result = FinishedRequest(
        status="completed",
        output=[{"index": 0, "text": "x"}],
        finish_reason="stop",
        prompt_tokens=prompt,
        completion_tokens=rng.randrange(0, 500),
        cached_tokens=rng.randrange(0, prompt),
        error=None,
        started_at=at,
        first_token_at=at,
        finished_at=at,
    )
    assert await store.finish(row.id, tenant_id, model, result)


def _files(jobs: Jobs, url: str, export_id: str) -> tuple[bytes, bytes]:
    async def get(database) -> BillingExport:
        async with database.sessionmaker() as session:
            return await session.get(BillingExport, export_id)

    export = _db(url, get)
    csv_path, jsonl_path = export_paths(jobs.export_dir, export)
    return csv_path.read_bytes(), jsonl_path.read_bytes()


def test_monthly_export_reconciles_reruns_identically_and_revises_for_a_late_request(
    jobs: Jobs, jobs_database: str
) -> None:
    tenant_id, keys, models = _db(jobs_database, lambda sm: _seed(sm, 300))
    first = jobs.run("pagewise.export_month", tenant_id, PERIOD)
    assert first["revision"] == 1
    csv_bytes, jsonl_bytes = _files(jobs, jobs_database, first["id"])
    assert hashlib.sha256(csv_bytes).hexdigest() == first["csv_sha256"]

    async def row_totals(database) -> tuple[int, int, int]:
        async with database.sessionmaker() as session:
            query = select(func.count(), func.sum(RequestRecord.cost_micros), func.sum(RequestRecord.prompt_tokens))
            return tuple(map(int, (await session.execute(query.where(RequestRecord.tenant_id == tenant_id))).one()))

    count, cost, prompt = _db(jobs_database, row_totals)
    records = list(csv.DictReader(io.StringIO(csv_bytes.decode())))
    usage, total = records[:-1], records[-1]
    assert total["kind"] == "total" and all(r["kind"] == "usage" for r in usage)
    assert (int(total["requests"]), int(total["cost_micros"]), int(total["prompt_tokens"])) == (count, cost, prompt)
    assert sum(int(r["cost_micros"]) for r in usage) == cost
    assert total["cost_usd"] == f"{cost // 10**6}.{cost % 10**6:06d}"  # exact to the micro-dollar, so to the cent
    assert {r["api_key_id"] for r in usage} <= set(keys) and {r["model"] for r in usage} <= set(models)
    assert [json.loads(line) for line in jsonl_bytes.decode().splitlines()][-1]["cost_micros"] == cost

    again = jobs.run("pagewise.export_month", tenant_id, PERIOD)
    assert again == first
    assert _files(jobs, jobs_database, first["id"]) == (csv_bytes, jsonl_bytes)

    async def late(database) -> None:
        await _request(
            RequestStore(database),
            tenant_id,
            keys[0],
            models[0],
            MONTH + dt.timedelta(days=DAYS - 1),
            random.Random(1),
        )

    _db(jobs_database, late)
    revised = jobs.run("pagewise.export_month", tenant_id, PERIOD)
    assert revised["revision"] == 2 and revised["csv_sha256"] != first["csv_sha256"]
    assert _files(jobs, jobs_database, first["id"]) == (csv_bytes, jsonl_bytes)  # revision 1 is never changed


def test_exports_refuse_unknown_tenants_and_future_periods(jobs: Jobs) -> None:
    import celery.exceptions  # noqa: F401 - the worker's errors come back as exceptions

    for args, message in (
        (("ten_missing", PERIOD), "no tenant"),
        (("ten_x", "2999-01"), "has not begun"),
        (("ten_x", "2031-13"), "YYYY-MM"),
    ):
        try:
            jobs.run("pagewise.export_month", *args)
        except Exception as error:  # noqa: BLE001 - re-raised by the result backend
            assert message in str(error)
        else:
            raise AssertionError(f"{args} was exported")


def test_retention_drops_old_bodies_and_keeps_usage_and_cost(jobs: Jobs, jobs_database: str) -> None:
    tenant_id, _, _ = _db(jobs_database, lambda sm: _seed(sm, 20))

    async def state(database) -> list[tuple]:
        async with database.sessionmaker() as session:
            query = select(
                RequestRecord.input, RequestRecord.output, RequestRecord.cost_micros, RequestRecord.body_purged_at
            ).where(RequestRecord.tenant_id == tenant_id)
            return [tuple(r) for r in (await session.execute(query.order_by(RequestRecord.id))).all()]

    before = _db(jobs_database, state)
    assert jobs.run("pagewise.purge_bodies") >= 20
    after = _db(jobs_database, state)
    assert [(i, o, c) for i, o, c, _ in after] == [({}, None, c) for _, _, c, _ in before]
    assert all(purged is not None for *_, purged in after)
    assert jobs.run("pagewise.purge_bodies") == 0  # nothing twice


def test_usage_check_finds_usage_daily_in_step_with_the_rows(jobs: Jobs, jobs_database: str) -> None:
    async def today(database) -> None:
        tenant_id, keys, models = await _seed(database, 0)
        now = dt.datetime.now(dt.UTC)
        for i in range(5):
            await _request(RequestStore(database), tenant_id, keys[i % 3], models[i % 2], now, random.Random(i))

    _db(jobs_database, today)
    assert jobs.run("pagewise.check_usage", days_ago=0) == []
