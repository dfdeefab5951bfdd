"""Key scopes and spend on both stores: a key's limits apply on top of its tenant's in the same atomic step, the
refusing scope is named, and spend is reserved at its upper bound and reconciled exactly once — to the bill when
the settlement gives it, so settled spend is the sum of the bills."""

from __future__ import annotations

import asyncio

import pytest

from pagewise.platform.quotas.quota_store import KeyQuota, QuotaLimits, QuotaStore
from pagewise.serving.protocol import SpendRate

pytestmark = pytest.mark.anyio

RATE = SpendRate(prompt_tokens=100, input_per_mtok_micros=1_000_000, output_per_mtok_micros=4_000_000)


def test_spend_rate_counts_prompt_tokens_first() -> None:
    assert RATE.cost(0) == 0
    assert RATE.cost(100) == 100  # 100 prompt tokens at $1 per million
    assert RATE.cost(150) == 300  # + 50 completion tokens at $4 per million
    assert SpendRate(1, 1, 1).cost(1) == 0  # 1e-6 micro-dollars rounds to 0


async def test_key_limits_apply_on_top_of_the_tenants(quota_store: QuotaStore) -> None:
    tenant = QuotaLimits(requests_per_minute=10)
    key = KeyQuota("key_a", QuotaLimits(requests_per_minute=2))
    decisions = [await quota_store.reserve("t", tenant, 1, f"r{i}", key=key) for i in range(3)]
    assert [(d.rejected_by, d.scope) for d in decisions] == [(None, "tenant"), (None, "tenant"), ("requests", "key")]
    assert decisions[2].key is not None and decisions[2].key.usage.requests_this_minute == 2
    assert (await quota_store.usage("t")).requests_this_minute == 2  # the refusal took nothing from the tenant
    other = await quota_store.reserve("t", tenant, 1, "r3", key=KeyQuota("key_b", QuotaLimits(requests_per_minute=2)))
    assert other.reservation is not None  # another key has its own counters
    assert (await quota_store.usage("key_a")).requests_this_minute == 2


async def test_the_tenant_is_checked_first_and_named(quota_store: QuotaStore) -> None:
    key = KeyQuota("key_a", QuotaLimits(tokens_per_minute=50))
    decision = await quota_store.reserve("t", QuotaLimits(tokens_per_minute=10), 20, "r1", key=key)
    assert (decision.rejected_by, decision.scope) == ("tokens", "tenant")
    assert (await quota_store.usage("key_a")).tokens_this_minute == 0


async def test_spend_is_reserved_then_reconciled_once_for_tenant_and_key(quota_store: QuotaStore) -> None:
    key = KeyQuota("key_a", QuotaLimits(monthly_spend_budget_micros=1_100))
    limits = QuotaLimits(monthly_spend_budget_micros=10_000)
    decision = await quota_store.reserve("t", limits, 300, "r1", key=key, rate=RATE)
    reservation = decision.reservation
    assert reservation is not None and reservation.spend == 100 + 800
    assert decision.usage.spend_this_month == 900 and decision.key.usage.spend_this_month == 900
    refused = await quota_store.reserve("t", limits, 300, "r2", key=key, rate=RATE)
    assert (refused.rejected_by, refused.scope) == ("monthly_spend", "key")
    assert await quota_store.reconcile(reservation, 120) is True  # 100 prompt + 20 completion tokens
    assert await quota_store.reconcile(reservation, 0) is False
    for scope_id in ("t", "key_a"):
        usage = await quota_store.usage(scope_id)
        assert (usage.spend_this_month, usage.tokens_this_month) == (180, 120), scope_id
    assert (await quota_store.reserve("t", limits, 300, "r3", key=key, rate=RATE)).reservation is not None


async def test_concurrent_requests_never_reserve_past_a_spend_budget(quota_store: QuotaStore) -> None:
    budget = 5 * RATE.cost(300) + 50  # room for five reservations, not six
    limits = QuotaLimits(monthly_spend_budget_micros=budget)
    decisions = await asyncio.gather(*(quota_store.reserve("t", limits, 300, f"r{i}", rate=RATE) for i in range(20)))
    admitted = [d.reservation for d in decisions if d.reservation is not None]
    assert len(admitted) == 5
    assert {d.rejected_by for d in decisions if d.reservation is None} == {"monthly_spend"}
    assert (await quota_store.usage("t")).spend_this_month == 5 * RATE.cost(300) <= budget


async def test_reconcile_settles_spend_to_the_bill_for_tenant_and_key(quota_store: QuotaStore) -> None:
    key = KeyQuota("key_a", QuotaLimits(monthly_spend_budget_micros=10_000))
    limits = QuotaLimits(monthly_spend_budget_micros=10_000)
    bills = [137, 0, 412]  # cheaper than the estimate (cached prompt tokens), nothing (failed), dearer (new price)
    reservations = []
    for i in range(len(bills)):
        decision = await quota_store.reserve("t", limits, 300, f"r{i}", key=key, rate=RATE)
        assert decision.reservation is not None
        reservations.append(decision.reservation)
    assert (await quota_store.usage("t")).spend_this_month == 3 * RATE.cost(300)
    for reservation, bill in zip(reservations, bills, strict=True):
        assert await quota_store.reconcile(reservation, 120, bill) is True
    assert await quota_store.reconcile(reservations[0], 120, 10**6) is False  # once per reservation
    for scope_id in ("t", "key_a"):
        usage = await quota_store.usage(scope_id)
        assert (usage.spend_this_month, usage.tokens_this_month) == (sum(bills), 3 * 120), scope_id
    assert RATE.cost(120) != 137  # the bill, not the rate's estimate of the same tokens
