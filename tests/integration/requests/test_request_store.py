"""`RequestStore`: the final write happens once (usage counted once), and leases fail orphaned rows only.

Times are in the year 2000, before any other test's lease, so a sweep here touches only this test's rows;
each test's tenant is deleted afterwards (its rows with it), so no expired lease outlives the test.
"""

from __future__ import annotations

import datetime as dt
import secrets
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from pagewise.platform.db.database import Database
from pagewise.platform.db.models import RequestRecord, Tenant, UsageDaily, as_utc
from pagewise.platform.requests.store import ORPHANED, RequestStore, row_error
from pagewise.platform.tenants.schemas import TenantCreate
from pagewise.platform.tenants.service import TenantService
from pagewise.serving.ledgers import Billed, FinishedRequest

from .rows import request_row

pytestmark = pytest.mark.anyio

T0 = dt.datetime(2000, 1, 1, 12, tzinfo=dt.UTC)
MINUTE = dt.timedelta(minutes=1)


@pytest.fixture
def sessionmaker(database: Database) -> async_sessionmaker[AsyncSession]:
    return database.sessionmaker


@pytest.fixture
async def tenant_id(sessionmaker: async_sessionmaker[AsyncSession]) -> AsyncIterator[str]:
    async with sessionmaker() as session:
        tenant = await TenantService(session).create(TenantCreate(name=f"store-{secrets.token_hex(4)}"))
    yield tenant.id
    async with sessionmaker() as session, session.begin():
        await session.execute(delete(Tenant).where(Tenant.id == tenant.id))


def _result(completion_tokens: int, status: str = "completed") -> FinishedRequest:
    return FinishedRequest(
        status=status,
        output=[{"index": 0, "text": "x" * completion_tokens, "finish_reason": "length"}],
        finish_reason="length",
        prompt_tokens=3,
        completion_tokens=completion_tokens,
        cached_tokens=0,
        error=None,
        started_at=T0,
        first_token_at=T0,
        finished_at=T0 + MINUTE,
    )


async def _rows(
    sessionmaker: async_sessionmaker[AsyncSession], tenant_id: str
) -> tuple[dict[str, RequestRecord], list[tuple[int, int]]]:
    """The tenant's rows by id, and its usage as (requests, completion_tokens) per usage_daily row."""
    async with sessionmaker() as session:
        rows = (await session.scalars(select(RequestRecord).where(RequestRecord.tenant_id == tenant_id))).all()
        usage = (
            await session.execute(
                select(UsageDaily.requests, UsageDaily.completion_tokens).where(UsageDaily.tenant_id == tenant_id)
            )
        ).all()
    return {r.id: r for r in rows}, [tuple(u) for u in usage]


async def test_finish_twice_adds_usage_once(
    database: Database, sessionmaker: async_sessionmaker[AsyncSession], tenant_id: str
) -> None:
    store = RequestStore(database)
    row = request_row(tenant_id, "completions", T0)
    await store.create(row)
    assert await store.finish(row.id, tenant_id, "m", _result(5)) == Billed(0)  # "m" has no price
    assert await store.finish(row.id, tenant_id, "m", _result(9, "cancelled")) is None
    rows, usage = await _rows(sessionmaker, tenant_id)
    assert (rows[row.id].status, rows[row.id].completion_tokens) == ("completed", 5)
    assert usage == [(1, 5)]


async def test_fail_orphans_touches_only_expired_unfinished_rows(
    database: Database, sessionmaker: async_sessionmaker[AsyncSession], tenant_id: str
) -> None:
    store = RequestStore(database)
    now = T0 + 10 * MINUTE
    expired, soon = now - MINUTE, now + MINUTE
    rows = {
        "expired queued": request_row(tenant_id, "completions", T0, lease_expires_at=expired),
        "expired running": request_row(tenant_id, "chat.completions", T0, status="running", lease_expires_at=expired),
        "live running": request_row(tenant_id, "completions", T0, status="running", lease_expires_at=soon),
        "expired completed": request_row(tenant_id, "completions", T0, status="completed", lease_expires_at=expired),
        "no lease": request_row(tenant_id, "completions", T0),
    }
    for row in rows.values():
        await store.create(row)
    assert await store.fail_orphans(now) == 2
    after, _ = await _rows(sessionmaker, tenant_id)
    states = {name: (after[r.id].status, row_error(after[r.id])) for name, r in rows.items()}
    assert states == {
        "expired queued": ("failed", ORPHANED),
        "expired running": ("failed", ORPHANED),
        "live running": ("running", None),
        "expired completed": ("completed", None),
        "no lease": ("queued", None),
    }
    assert as_utc(after[rows["expired queued"].id].finished_at) == now
    assert after[rows["expired completed"].id].finished_at is None
    assert await store.fail_orphans(now) == 0


async def test_finish_after_orphan_sweep_loses_and_adds_no_usage(
    database: Database, sessionmaker: async_sessionmaker[AsyncSession], tenant_id: str
) -> None:
    store = RequestStore(database)
    row = request_row(tenant_id, "completions", T0, status="running", lease_expires_at=T0 + MINUTE)
    await store.create(row)
    assert await store.fail_orphans(T0 + 2 * MINUTE) == 1
    assert await store.finish(row.id, tenant_id, "m", _result(5)) is None
    rows, usage = await _rows(sessionmaker, tenant_id)
    assert (rows[row.id].status, rows[row.id].completion_tokens, usage) == ("failed", 0, [])


async def test_renew_leases_moves_only_unfinished_rows(
    database: Database, sessionmaker: async_sessionmaker[AsyncSession], tenant_id: str
) -> None:
    store = RequestStore(database)
    queued = request_row(tenant_id, "completions", T0, lease_expires_at=T0)
    running = request_row(tenant_id, "chat.completions", T0, status="running", lease_expires_at=T0)
    done = request_row(tenant_id, "completions", T0, status="completed", lease_expires_at=T0)
    for row in (queued, running, done):
        await store.create(row)
    await store.renew_leases([], T0 + MINUTE)
    await store.renew_leases({queued.id, running.id, done.id}, T0 + 5 * MINUTE)
    rows, _ = await _rows(sessionmaker, tenant_id)
    leases = {r: as_utc(rows[r.id].lease_expires_at) for r in (queued, running, done)}
    assert leases == {queued: T0 + 5 * MINUTE, running: T0 + 5 * MINUTE, done: T0}
    assert await store.fail_orphans(T0 + 4 * MINUTE) == 0
