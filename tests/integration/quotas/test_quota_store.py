"""The same quota semantics on the in-process store and on the real Redis."""

from __future__ import annotations

import asyncio

import pytest

from pagewise.platform.quotas.quota_store import QuotaLimits, QuotaStore

from ..conftest import FROZEN_NOW, QuotaStoreFactory

pytestmark = pytest.mark.anyio


async def test_32_concurrent_reservations_against_10_slots_admit_exactly_10(quota_store: QuotaStore) -> None:
    limits = QuotaLimits(max_concurrent_requests=10)
    decisions = await asyncio.gather(*(quota_store.reserve("t", limits, 5, f"r{i}") for i in range(32)))
    admitted = [d.reservation for d in decisions if d.reservation is not None]
    assert len(admitted) == 10
    assert {d.rejected_by for d in decisions if d.reservation is None} == {"concurrency"}
    assert (await quota_store.usage("t")).concurrent == 10
    assert all(await asyncio.gather(*(quota_store.reconcile(r, 3) for r in admitted)))
    usage = await quota_store.usage("t")
    assert (usage.concurrent, usage.outstanding) == (0, 0)
    assert (usage.tokens_this_minute, usage.requests_this_minute) == (30, 10)


async def test_reconcile_happens_exactly_once(quota_store: QuotaStore) -> None:
    decision = await quota_store.reserve("t", QuotaLimits(tokens_per_minute=100), 40, "r1")
    assert decision.reservation is not None and decision.usage.tokens_this_minute == 40
    assert await quota_store.reconcile(decision.reservation, 10) is True
    assert await quota_store.reconcile(decision.reservation, 10) is False
    usage = await quota_store.usage("t")
    assert (usage.concurrent, usage.tokens_this_minute, usage.tokens_this_month) == (0, 10, 10)


async def test_rejection_changes_nothing(quota_store: QuotaStore) -> None:
    limits = QuotaLimits(requests_per_minute=5, tokens_per_minute=100)
    assert (await quota_store.reserve("t", limits, 60, "r1")).reservation is not None
    rejected = await quota_store.reserve("t", limits, 60, "r2")
    assert rejected.reservation is None and rejected.rejected_by == "tokens"
    usage = await quota_store.usage("t")
    assert (usage.concurrent, usage.requests_this_minute, usage.tokens_this_minute) == (1, 1, 60)


async def test_requests_per_minute_and_monthly_budget(quota_store: QuotaStore) -> None:
    per_minute = QuotaLimits(requests_per_minute=2)
    results = [await quota_store.reserve("a", per_minute, 1, f"a{i}") for i in range(3)]
    assert [r.rejected_by for r in results] == [None, None, "requests"]
    budget = QuotaLimits(monthly_token_budget=50)
    first = await quota_store.reserve("b", budget, 30, "b1")
    assert first.reservation is not None
    assert (await quota_store.reserve("b", budget, 30, "b2")).rejected_by == "monthly_budget"
    await quota_store.reconcile(first.reservation, 5)  # refund: 5 of 50 used
    assert (await quota_store.reserve("b", budget, 30, "b3")).rejected_by is None


async def test_tenants_do_not_share_counters(quota_store: QuotaStore) -> None:
    limits = QuotaLimits(max_concurrent_requests=1)
    assert (await quota_store.reserve("a", limits, 1, "a1")).reservation is not None
    assert (await quota_store.reserve("b", limits, 1, "b1")).reservation is not None
    assert (await quota_store.reserve("a", limits, 1, "a2")).rejected_by == "concurrency"


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def test_an_expired_lease_gives_its_slot_back(quota_store_factory: QuotaStoreFactory) -> None:
    """A process that reserved and crashed holds its slot only until the lease runs out."""
    clock = _Clock(FROZEN_NOW)
    store = quota_store_factory(clock, lease_s=10.0)
    limits = QuotaLimits(max_concurrent_requests=1, tokens_per_minute=1000)
    crashed = (await store.reserve("t", limits, 40, "crashed")).reservation
    assert crashed is not None
    clock.now += 9.9
    assert (await store.reserve("t", limits, 1, "early")).rejected_by == "concurrency"
    clock.now += 0.2  # past the lease
    assert (await store.usage("t")).concurrent == 0
    later = await store.reserve("t", limits, 1, "later")
    assert later.reservation is not None and later.usage.concurrent == 1
    assert await store.reconcile(crashed, 0) is False  # too late: nothing to release, tokens stay counted
    usage = await store.usage("t")
    assert (usage.concurrent, usage.outstanding, usage.tokens_this_minute) == (1, 1, 41)
    assert await store.reconcile(later.reservation, 1) is True
    assert (await store.usage("t")).concurrent == 0


async def test_renew_extends_a_live_lease_only(quota_store_factory: QuotaStoreFactory) -> None:
    clock = _Clock(FROZEN_NOW)
    store = quota_store_factory(clock, lease_s=10.0)
    limits = QuotaLimits(max_concurrent_requests=1)
    held = (await store.reserve("t", limits, 1, "held")).reservation
    assert held is not None
    clock.now += 8
    assert await store.renew(held) is True
    clock.now += 8  # 16 s after reserving, 8 s after renewing: still held
    assert (await store.reserve("t", limits, 1, "other")).rejected_by == "concurrency"
    clock.now += 3  # the renewed lease ran out
    assert await store.renew(held) is False
    assert (await store.reserve("t", limits, 1, "other")).reservation is not None
    assert await store.reconcile(held, 1) is False


async def test_a_reservation_holds_its_slots_until_reconciled_once(quota_store: QuotaStore) -> None:
    limits = QuotaLimits(max_concurrent_requests=4)
    three = await quota_store.reserve("t", limits, 10, "three", slots=3)
    assert three.reservation is not None and three.reservation.slots == 3
    assert (three.usage.concurrent, three.usage.outstanding) == (3, 1)
    refused = await quota_store.reserve("t", limits, 10, "two", slots=2)  # 3 + 2 > 4
    assert refused.rejected_by == "concurrency" and refused.usage.concurrent == 3
    one = (await quota_store.reserve("t", limits, 10, "one")).reservation
    assert one is not None and one.slots == 1
    usage = await quota_store.usage("t")
    assert (usage.concurrent, usage.outstanding, usage.requests_this_minute) == (4, 2, 2)
    assert await quota_store.reconcile(three.reservation, 4) is True
    assert await quota_store.reconcile(three.reservation, 4) is False  # a second reconcile frees nothing
    usage = await quota_store.usage("t")
    assert (usage.concurrent, usage.outstanding, usage.tokens_this_minute) == (1, 1, 14)
    assert (await quota_store.reserve("t", limits, 1, "three-again", slots=3)).reservation is not None


async def test_concurrent_multi_slot_reservations_never_oversubscribe(quota_store: QuotaStore) -> None:
    limits = QuotaLimits(max_concurrent_requests=10)
    decisions = await asyncio.gather(
        *(quota_store.reserve("t", limits, 1, f"r{i}", slots=3) for i in range(16))
    )
    admitted = [d.reservation for d in decisions if d.reservation is not None]
    assert len(admitted) == 3  # 3 × 3 = 9 slots; a fourth would need 12
    assert (await quota_store.usage("t")).concurrent == 9
    results = await asyncio.gather(*(quota_store.reconcile(admitted[0], 1) for _ in range(8)))
    assert sorted(results) == [False] * 7 + [True]
    assert (await quota_store.usage("t")).concurrent == 6


async def test_slots_and_tokens_must_be_sane(quota_store: QuotaStore) -> None:
    with pytest.raises(ValueError, match="slots must be at least 1; got 0"):
        await quota_store.reserve("t", QuotaLimits(), 1, "r", slots=0)
    with pytest.raises(ValueError, match="tokens must be at least 0; got -1"):
        await quota_store.reserve("t", QuotaLimits(), -1, "r")
    usage = await quota_store.usage("t")
    assert (usage.concurrent, usage.requests_this_minute) == (0, 0)


async def test_an_expired_lease_gives_all_its_slots_back(quota_store_factory: QuotaStoreFactory) -> None:
    clock = _Clock(FROZEN_NOW)
    store = quota_store_factory(clock, lease_s=10.0)
    limits = QuotaLimits(max_concurrent_requests=4)
    crashed = (await store.reserve("t", limits, 5, "crashed", slots=4)).reservation
    assert crashed is not None
    clock.now += 9.9
    assert (await store.reserve("t", limits, 1, "early")).rejected_by == "concurrency"
    clock.now += 0.2
    usage = await store.usage("t")
    assert (usage.concurrent, usage.outstanding) == (0, 0)
    later = (await store.reserve("t", limits, 1, "later", slots=4)).reservation
    assert later is not None
    assert await store.reconcile(crashed, 0) is False  # frees none of `later`'s slots
    assert (await store.usage("t")).concurrent == 4
    assert await store.reconcile(later, 1) is True
    assert (await store.usage("t")).concurrent == 0


async def test_renew_keeps_all_slots(quota_store_factory: QuotaStoreFactory) -> None:
    clock = _Clock(FROZEN_NOW)
    store = quota_store_factory(clock, lease_s=10.0)
    limits = QuotaLimits(max_concurrent_requests=3)
    held = (await store.reserve("t", limits, 1, "held", slots=3)).reservation
    assert held is not None
    clock.now += 8
    assert await store.renew(held) is True
    clock.now += 8  # past the first lease, within the renewed one
    usage = await store.usage("t")
    assert (usage.concurrent, usage.outstanding) == (3, 1)
    assert (await store.reserve("t", limits, 1, "other")).rejected_by == "concurrency"
    clock.now += 3
    assert await store.renew(held) is False
    assert (await store.usage("t")).concurrent == 0
    assert (await store.reserve("t", limits, 1, "other", slots=3)).reservation is not None


async def test_a_batch_line_counts_in_the_month_only(quota_store: QuotaStore) -> None:
    """Not `interactive`: no concurrency slot, nothing of the minute's requests or tokens; the month's tokens (and
    budget) as any request; reconciled once, the minute untouched."""
    limits = QuotaLimits(monthly_token_budget=100)
    decision = await quota_store.reserve("t", limits, 40, "b1", slots=2, interactive=False)
    reservation = decision.reservation
    assert reservation is not None and (reservation.slots, reservation.minute) == (0, -1)
    usage = await quota_store.usage("t")
    assert (usage.concurrent, usage.outstanding, usage.requests_this_minute, usage.tokens_this_minute) == (0, 1, 0, 0)
    assert usage.tokens_this_month == 40
    assert (await quota_store.reserve("t", limits, 70, "b2", interactive=False)).rejected_by == "monthly_budget"
    one = QuotaLimits(requests_per_minute=1, max_concurrent_requests=1)
    assert (await quota_store.reserve("t", one, 1, "i1")).reservation is not None  # the interactive room is whole
    assert await quota_store.reconcile(reservation, 25) is True
    assert await quota_store.reconcile(reservation, 25) is False
    usage = await quota_store.usage("t")
    assert (usage.concurrent, usage.requests_this_minute, usage.tokens_this_minute) == (1, 1, 1)
    assert usage.tokens_this_month == 26
