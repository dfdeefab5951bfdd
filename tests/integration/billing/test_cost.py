"""A request's cost is computed once, when it is settled, from the price in effect at its `finished_at`; the row
and its day's usage (per key) get the same integer; `/v1/usage` and `/admin/usage` report spend by key."""

from __future__ import annotations

import datetime as dt
import secrets

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.db.ids import new_id
from pagewise.platform.db.models import ModelPrice, RequestRecord, UsageDaily
from pagewise.platform.requests.store import RequestStore
from pagewise.serving.ledgers import FinishedRequest

from ..harness import Platform, bearer, chat_body
from ..requests.rows import request_row
from .prices import ensure_price

pytestmark = pytest.mark.anyio

T0 = dt.datetime(2031, 3, 10, 12, tzinfo=dt.UTC)


def _finished(at: dt.datetime, prompt: int, cached: int, completion: int) -> FinishedRequest:
    return FinishedRequest(
        status="completed", output=[], finish_reason="stop", prompt_tokens=prompt, completion_tokens=completion,
        cached_tokens=cached, error=None, started_at=at, first_token_at=at, finished_at=at,
    )


async def _price(session: AsyncSession, model: str, at: dt.datetime, inp: int, cached: int, out: int) -> ModelPrice:
    """A price version written straight to the table (the service refuses back-dated ones)."""
    price = ModelPrice(
        id=new_id("price"), model=model, input_per_mtok_micros=inp, cached_input_per_mtok_micros=cached,
        output_per_mtok_micros=out, effective_from=at,
    )
    session.add(price)
    await session.commit()
    return price


async def _settle(store: RequestStore, session: AsyncSession, tenant_id: str, key_id: str | None, model: str,
                  result: FinishedRequest) -> RequestRecord:
    row = request_row(tenant_id, "completions", result.finished_at, api_key_id=key_id)
    row.model = model
    await store.create(row)
    assert await store.finish(row.id, tenant_id, model, result)
    return await _row(session, row.id)


async def _row(session: AsyncSession, request_id: str) -> RequestRecord:
    return await session.get(RequestRecord, request_id, populate_existing=True)


async def test_cost_uses_the_price_in_effect_when_the_request_finished(platform: Platform, session: AsyncSession):
    tenant, _ = await platform.tenant_with_key()
    keys = [await _key_id(platform, tenant["id"]) for _ in range(2)]
    model = f"m-{secrets.token_hex(4)}"
    old = await _price(session, model, T0, 150_000, 75_000, 600_000)
    new = await _price(session, model, T0 + dt.timedelta(hours=1), 300_000, 100_000, 1_200_000)
    store = platform.services.requests
    just_before = T0 + dt.timedelta(minutes=59)
    before = await _settle(store, session, tenant["id"], keys[0], model, _finished(just_before, 1000, 200, 333))
    # (800 × 0.15 + 200 × 0.075 + 333 × 0.6) micro-dollars = 120 + 15 + 199.8 → 335
    assert (before.cost_micros, before.price_id) == (335, old.id)
    after = await _settle(store, session, tenant["id"], keys[1], model, _finished(T0 + dt.timedelta(hours=1), 7, 0, 1))
    # 7 × 0.3 + 1 × 1.2 = 3.3 → 3 (rounded once, half up)
    assert (after.cost_micros, after.price_id) == (3, new.id)
    again = await _settle(store, session, tenant["id"], keys[1], model, _finished(T0 + dt.timedelta(hours=2), 5, 0, 0))
    assert again.cost_micros == 2  # 1.5 → 2
    assert (await _row(session, before.id)).cost_micros == 335  # a later price never changes a settled cost

    usage = (await session.scalars(select(UsageDaily).where(UsageDaily.tenant_id == tenant["id"]))).all()
    by_key = {u.api_key_id: (u.requests, u.cost_micros, u.prompt_tokens) for u in usage}
    assert by_key == {keys[0]: (1, 335, 1000), keys[1]: (2, 5, 12)}


async def test_unpriced_model_costs_nothing_and_a_lost_race_bills_nothing(platform: Platform, session: AsyncSession):
    tenant, _ = await platform.tenant_with_key()
    store = platform.services.requests
    row = await _settle(store, session, tenant["id"], None, f"free-{secrets.token_hex(4)}", _finished(T0, 10, 0, 10))
    assert (row.cost_micros, row.price_id) == (0, None)
    assert not await store.finish(row.id, tenant["id"], row.model, _finished(T0, 10**6, 0, 10**6))
    usage = (await session.scalars(select(UsageDaily).where(UsageDaily.tenant_id == tenant["id"]))).all()
    assert [(u.api_key_id, u.requests, u.prompt_tokens) for u in usage] == [("", 1, 10)]


async def _key_id(platform: Platform, tenant_id: str) -> str:
    response = await platform.http.post(
        f"/admin/tenants/{tenant_id}/keys", json={}, headers=bearer(platform.admin_key)
    )
    return response.json()["id"]


async def test_served_requests_are_billed_and_usage_reports_spend_by_key(platform: Platform, session: AsyncSession):
    await ensure_price(platform)
    tenant, first = await platform.tenant_with_key()
    second = await platform.create_key(tenant["id"])
    for key, count in ((first, 2), (second, 1)):
        for i in range(count):
            response = await platform.http.post("/v1/chat/completions", json=chat_body(f"hi {i}"), headers=bearer(key))
            assert response.status_code == 200, response.text
    rows = (await session.scalars(select(RequestRecord).where(RequestRecord.tenant_id == tenant["id"]))).all()
    price = await session.get(ModelPrice, rows[0].price_id)
    for row in rows:
        expected = (row.prompt_tokens - row.cached_tokens) * 2_000_000 + row.cached_tokens * 1_000_000
        assert row.cost_micros == (expected + row.completion_tokens * 8_000_000 + 500_000) // 1_000_000
        assert row.price_id == price.id
    spend: dict[str, int] = {}
    for row in rows:
        spend[row.api_key_id] = spend.get(row.api_key_id, 0) + row.cost_micros
    start = int((dt.datetime.now(dt.UTC) - dt.timedelta(days=1)).timestamp())
    for path, caller, extra in (
        ("/v1/usage", first, {}),
        ("/admin/usage", platform.admin_key, {"tenant_id": tenant["id"]}),
    ):
        for width in ("1d", "1h"):
            params = {"start_time": start, "bucket_width": width, "group_by": ["api_key_id"], **extra}
            response = await platform.http.get(path, params=params, headers=bearer(caller))
            assert response.status_code == 200, response.text
            results = [r for b in response.json()["data"] for r in b["results"]]
            assert {r["api_key_id"]: r["cost_micros"] for r in results} == spend, (path, width)
            assert sum(r["num_model_requests"] for r in results) == 3
