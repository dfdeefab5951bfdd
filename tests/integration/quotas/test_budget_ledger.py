"""Monthly budgets start from the database: a new store (a restart), a store whose Redis lost its counters
(a flush) and a rotated key all see what was billed this month, on both stores and both databases — never a
fresh month, and never more admitted than the budget."""

from __future__ import annotations

import asyncio
import datetime as dt
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import redis.asyncio as redis
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.engine.async_engine import AsyncLLMEngine
from pagewise.platform.app import create_app
from pagewise.platform.db.database import Database
from pagewise.platform.db.models import RequestRecord, UsageDaily
from pagewise.platform.keys.auth import key_quota
from pagewise.platform.keys.schemas import KeyCreate
from pagewise.platform.keys.service import KeyService
from pagewise.platform.quotas.ledger import DatabaseLedger, month_days
from pagewise.platform.quotas.memory_store import InProcessQuotaStore
from pagewise.platform.quotas.quota_store import KeyQuota, MonthToDate, QuotaLimits, QuotaStore, Scope
from pagewise.platform.quotas.redis_store import RedisQuotaStore
from pagewise.platform.requests.store import RequestStore
from pagewise.platform.settings import Settings
from pagewise.platform.tenants.schemas import TenantCreate
from pagewise.platform.tenants.service import TenantService

from ..conftest import FROZEN_NOW, REDIS_URL
from ..harness import MODEL, bearer

pytestmark = pytest.mark.anyio

DAY = dt.datetime.fromtimestamp(FROZEN_NOW, dt.UTC).date()
MONTH = DAY.strftime("%Y%m")


class CountingLedger:
    """The database ledger, counting its reads (a seed must happen once per scope and month)."""

    def __init__(self, database: Database) -> None:
        self.ledger = DatabaseLedger(database)
        self.reads: list[tuple[Scope, str]] = []

    async def month_to_date(self, scope: Scope, scope_id: str, month: str) -> MonthToDate:
        self.reads.append((scope, scope_id))
        await asyncio.sleep(0.01)  # a slow database: concurrent reservations all arrive before the seed
        return await self.ledger.month_to_date(scope, scope_id, month)


@pytest.fixture(params=["memory", "redis"])
async def make_store(request: pytest.FixtureRequest, redis_key_prefix: str):
    """`make_store(ledger)`: a new store of one kind on the frozen clock, as a restarted server builds it."""
    stores: list[QuotaStore] = []

    def make(ledger) -> QuotaStore:
        if request.param == "memory":
            store: QuotaStore = InProcessQuotaStore(lambda: FROZEN_NOW, ledger=ledger)
        else:
            store = RedisQuotaStore.from_url(REDIS_URL, redis_key_prefix, lambda: FROZEN_NOW, ledger=ledger)
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.close()


async def new_tenant(session: AsyncSession) -> str:
    tenant = await TenantService(session).create(TenantCreate(name=f"ledger-{secrets.token_hex(4)}"))
    return tenant.id


async def bill(database: Database, tenant_id: str, day: dt.date, tokens: int, cost: int, key_id: str = "") -> None:
    """A settled month's usage as the settlement writes it (prompt + completion tokens and the bill)."""
    row = dict(
        tenant_id=tenant_id,
        day=day,
        model="m",
        api_key_id=key_id,
        requests=1,
        prompt_tokens=tokens - 1,
        completion_tokens=1,
        cached_tokens=0,
        cost_micros=cost,
    )
    await database.run(lambda connection: connection.execute(insert(UsageDaily.__table__), row))


async def test_the_ledger_sums_this_months_usage_only(database: Database, session: AsyncSession) -> None:
    tenant = await new_tenant(session)
    first, following = month_days(MONTH)
    await bill(database, tenant, first, 10, 100)
    await bill(database, tenant, following - dt.timedelta(days=1), 5, 7, key_id="key_x")
    await bill(database, tenant, first - dt.timedelta(days=1), 1000, 1000)  # last month
    await bill(database, tenant, following, 1000, 1000)  # next month
    ledger = DatabaseLedger(database)
    assert await ledger.month_to_date("tenant", tenant, MONTH) == MonthToDate(tokens=15, spend=107)
    assert await ledger.month_to_date("key", "key_x", MONTH) == MonthToDate(tokens=5, spend=7)
    assert await ledger.month_to_date("tenant", "nobody", MONTH) == MonthToDate(tokens=0, spend=0)


async def test_a_restarted_store_starts_from_what_was_billed(make_store, database: Database, session) -> None:
    tenant = await new_tenant(session)
    await bill(database, tenant, DAY, 35, 900)
    store = make_store(DatabaseLedger(database))
    limits = QuotaLimits(monthly_token_budget=40)
    refused = await store.reserve(tenant, limits, 10, "r1")
    assert (refused.rejected_by, refused.usage.tokens_this_month) == ("monthly_budget", 35)
    admitted = await store.reserve(tenant, limits, 5, "r2")
    assert admitted.reservation is not None and admitted.usage.tokens_this_month == 40
    spend = QuotaLimits(monthly_spend_budget_micros=1000)
    assert (await store.reserve(tenant, spend, 0, "r3")).usage.spend_this_month == 900


async def test_redis_counters_lost_are_rebuilt_not_reset(database: Database, session, redis_key_prefix):
    """Redis lost every key of the store (a flush, a restart without persistence) after a request was settled:
    the next reservation rebuilds the month from the database. (An in-process store loses its counters only
    with its process: the restart test.)"""
    tenant = await new_tenant(session)
    store = RedisQuotaStore.from_url(REDIS_URL, redis_key_prefix, lambda: FROZEN_NOW, ledger=DatabaseLedger(database))
    limits = QuotaLimits(monthly_token_budget=40)
    first = (await store.reserve(tenant, limits, 30, "r1")).reservation
    assert first is not None
    await bill(database, tenant, DAY, 30, 0)  # the settlement: usage row, then the reconcile
    assert await store.reconcile(first, 30)
    client = redis.Redis.from_url(REDIS_URL)
    await client.delete(*[key async for key in client.scan_iter(match=f"{redis_key_prefix}*")])
    await client.aclose()
    decision = await store.reserve(tenant, limits, 20, "r2")
    await store.close()
    assert (decision.rejected_by, decision.usage.tokens_this_month) == ("monthly_budget", 30)


async def test_concurrent_first_reservations_seed_once_and_admit_within_budget(
    make_store, database: Database, session
) -> None:
    tenant = await new_tenant(session)
    await bill(database, tenant, DAY, 30, 0)
    ledger = CountingLedger(database)
    store = make_store(ledger)
    limits = QuotaLimits(monthly_token_budget=40)
    decisions = await asyncio.gather(*(store.reserve(tenant, limits, 1, f"r{i}") for i in range(25)))
    assert sum(d.reservation is not None for d in decisions) == 10
    assert {d.rejected_by for d in decisions if d.reservation is None} == {"monthly_budget"}
    assert (await store.usage(tenant)).tokens_this_month == 40
    # every racer may read the ledger while none has seeded yet, but the counter is seeded once
    assert 1 <= len(ledger.reads) <= 25 and set(ledger.reads) == {("tenant", tenant)}
    again = len(ledger.reads)
    await store.reserve(tenant, limits, 0, "later")
    assert len(ledger.reads) == again  # seeded: no more reads this month


async def test_a_rotated_key_continues_its_budget(make_store, database: Database, session) -> None:
    tenant = await new_tenant(session)
    keys = KeyService(session)
    original = await keys.create(tenant, KeyCreate(scopes=["inference"], monthly_token_budget=60))
    rotated = await keys.rotate(tenant, original.id)
    again = await keys.rotate(tenant, rotated.id, grace_period_s=60)
    await bill(database, tenant, DAY, 50, 0, key_id=original.id)
    store = make_store(DatabaseLedger(database))
    rows = {row.id: row for row in [await keys.get(tenant, k.id) for k in (original, rotated, again)]}
    quotas = {key_id: key_quota(row) for key_id, row in rows.items()}
    assert {q.key_id for q in quotas.values()} == {original.id}  # one counter for the lineage
    newest = quotas[again.id]
    refused = await store.reserve(tenant, QuotaLimits(), 20, "r1", key=newest)
    assert (refused.rejected_by, refused.scope) == ("monthly_budget", "key")
    assert refused.key is not None and refused.key.usage.tokens_this_month == 50
    assert (await store.reserve(tenant, QuotaLimits(), 10, "r2", key=newest)).reservation is not None
    assert (await store.reserve(tenant, QuotaLimits(), 1, "r3", key=quotas[rotated.id])).rejected_by == (
        "monthly_budget"
    )
    other = KeyQuota("key_unrelated", QuotaLimits(monthly_token_budget=60))
    assert (await store.reserve(tenant, QuotaLimits(), 20, "r4", key=other)).reservation is not None


@asynccontextmanager
async def served(settings: Settings, engine: AsyncLLMEngine) -> AsyncIterator[httpx.AsyncClient]:
    """One run of the server as `pagewise serve` builds it (its own quota store, seeded from the database)."""
    app = create_app(settings, engine=engine)
    async with app.lifespan():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as http:
            yield http


async def test_a_restarted_server_keeps_refusing_a_spent_budget(
    database_url: str, database: Database, session: AsyncSession, llm_engine: AsyncLLMEngine
) -> None:
    """The issue's reproduction: a 40-token monthly budget spent, the server restarted, the key tried again."""
    tenant = await TenantService(session).create(
        TenantCreate(name=f"budget-{secrets.token_hex(4)}", monthly_token_budget=40)
    )
    key = (await KeyService(session).create(tenant.id, KeyCreate(scopes=["inference"]))).key
    settings = Settings.from_env({}, database_url=database_url, auto_migrate=False)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 8, "temperature": 0}
    async with served(settings, llm_engine) as http:
        statuses = [(await http.post("/v1/completions", json=body, headers=bearer(key))).status_code for _ in range(6)]
    assert statuses[0] == 200 and statuses[-1] == 429, statuses
    month = dt.datetime.now(dt.UTC).strftime("%Y%m")
    billed = (await DatabaseLedger(database).month_to_date("tenant", tenant.id, month)).tokens
    assert 0 < billed <= 40
    for _ in range(2):  # each restart's new store rebuilds the month from usage_daily
        async with served(settings, llm_engine) as http:
            refused = await http.post("/v1/completions", json=body, headers=bearer(key))
        assert refused.status_code == 429, refused.text
        assert "monthly" in refused.json()["error"]["message"].lower()
    assert (await DatabaseLedger(database).month_to_date("tenant", tenant.id, month)).tokens == billed


async def test_unfinished_requests_count_at_their_reservation(database: Database, session, redis_key_prefix):
    """Redis lost its data while a request was in flight: its reservation is gone and its usage not billed yet,
    so the rebuilt month counts it at what it reserved (a finished one at what it billed) — the budget holds."""
    tenant = await new_tenant(session)
    await bill(database, tenant, DAY, 10, 0)
    queued_at = dt.datetime.fromtimestamp(FROZEN_NOW, dt.UTC)
    for status, reserved in (("running", 25), ("completed", 1000), ("queued", 3)):
        await RequestStore(database).create(
            RequestRecord(id=f"req_{secrets.token_hex(6)}", tenant_id=tenant, endpoint="chat.completions", model="m",
                          input={}, params={}, status=status, queued_at=queued_at, reserved_tokens=reserved)
        )
    assert await DatabaseLedger(database).month_to_date("tenant", tenant, MONTH) == MonthToDate(tokens=38, spend=0)
    store = RedisQuotaStore.from_url(REDIS_URL, redis_key_prefix, lambda: FROZEN_NOW, ledger=DatabaseLedger(database))
    limits = QuotaLimits(monthly_token_budget=40)
    refused = await store.reserve(tenant, limits, 5, "r1")
    admitted = await store.reserve(tenant, limits, 2, "r2")
    await store.close()
    assert (refused.rejected_by, refused.usage.tokens_this_month) == ("monthly_budget", 38)
    assert admitted.reservation is not None
