"""Served requests on both stores: once they are settled, the tenant's and the key's spend counters are the sum of
their rows' costs — the bill, not the reservation's upper bound (cached prompt tokens cost less than it assumed)."""

from __future__ import annotations

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.db.models import RequestRecord
from pagewise.platform.quotas.quota_store import QuotaStore

from ..billing.prices import PRICE, ensure_price, micros
from ..harness import Platform, bearer, chat_body

pytestmark = pytest.mark.anyio

SYSTEM = "You are a careful assistant. " * 12  # several full blocks: a repeat hits the prefix cache


@pytest.fixture
def platform_quota_store(quota_store: QuotaStore) -> QuotaStore:
    return quota_store


async def test_settled_spend_is_the_sum_of_the_bills(platform: Platform, session: AsyncSession) -> None:
    await ensure_price(platform)
    tenant = await platform.create_tenant(monthly_spend_budget_micros=10**9)
    created = await platform.http.post(
        f"/admin/tenants/{tenant['id']}/keys",
        json={"monthly_spend_budget_micros": 10**8},
        headers=bearer(platform.admin_key),
    )
    key, key_id = created.json()["key"], created.json()["id"]
    for question in ("Say hi", "Say bye", "Say hi"):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        body = chat_body(messages=messages)
        response = await platform.http.post("/v1/chat/completions", json=body, headers=bearer(key))
        assert response.status_code == 200, response.text
    rows = (await session.scalars(select(RequestRecord).where(RequestRecord.tenant_id == tenant["id"]))).all()
    assert len(rows) == 3 and any(r.cached_tokens for r in rows)
    estimates = [
        (r.prompt_tokens * micros(PRICE, "input") + r.completion_tokens * micros(PRICE, "output")
         + 500_000) // 10**6
        for r in rows
    ]
    bills = sum(r.cost_micros for r in rows)
    assert bills < sum(estimates)  # what reconciling to the tokens' upper bound would have left counted
    for scope_id in (tenant["id"], key_id):
        usage = await platform.services.quotas.usage(scope_id)
        assert (usage.spend_this_month, usage.outstanding) == (bills, 0), scope_id
