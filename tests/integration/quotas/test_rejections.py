"""What a refused request is told, on both stores: the 429 names the limit that refused with its numbers;
a request no window could ever admit is a 400 (`never_fits`) before anything is reserved."""

from __future__ import annotations

import pytest

from pagewise.platform.quotas.admission import never_fits
from pagewise.platform.quotas.headers import format_reset, quota_exceeded
from pagewise.platform.quotas.quota_store import QuotaLimits, QuotaStore

pytestmark = pytest.mark.anyio

MONTH_RESETS = "16d15h59m30s"  # from FROZEN_NOW (2027-01-15 08:00:30 UTC) to February


def test_format_reset() -> None:
    assert [format_reset(s) for s in (0, 0.2, 12, 60, 90, 3600, 90061)] == [
        "0s",
        "1s",
        "12s",
        "1m0s",
        "1m30s",
        "1h0m0s",
        "1d1h1m1s",
    ]


async def test_tokens_per_minute_429_states_limit_used_remaining_and_request(quota_store: QuotaStore) -> None:
    limits = QuotaLimits(tokens_per_minute=2000)
    assert (await quota_store.reserve("t", limits, 1500, "r1")).reservation is not None
    decision = await quota_store.reserve("t", limits, 900, "r2")
    error = quota_exceeded(decision, 900)
    assert (error.status_code, error.code, error.type) == (429, "rate_limit_exceeded", "rate_limit_error")
    assert error.message == (
        "Rate limit reached for tokens per minute (the tenant's limit): limit 2,000, used 1,500, remaining 500, "
        "requested 900; resets in 30s"
    )
    assert error.headers["Retry-After"] == "30" and error.headers["x-ratelimit-remaining-tokens"] == "500"


async def test_requests_per_minute_429(quota_store: QuotaStore) -> None:
    limits = QuotaLimits(requests_per_minute=2)
    for i in range(2):
        await quota_store.reserve("t", limits, 1, f"r{i}")
    error = quota_exceeded(await quota_store.reserve("t", limits, 1, "r2"), 1)
    assert error.message == (
        "Rate limit reached for requests per minute (the tenant's limit): limit 2, used 2, remaining 0, requested 1; "
        "resets in 30s"
    )


async def test_concurrency_429_counts_slots(quota_store: QuotaStore) -> None:
    limits = QuotaLimits(max_concurrent_requests=4)
    await quota_store.reserve("t", limits, 1, "r1", slots=3)
    error = quota_exceeded(await quota_store.reserve("t", limits, 1, "r2", slots=2), 1, 2)
    assert error.message == (
        "Concurrency limit reached (the tenant's limit): limit 4, in use 3, requested 2; "
        "retry when a running request finishes"
    )
    assert (error.code, error.headers["Retry-After"]) == ("rate_limit_exceeded", "1")


async def test_monthly_budget_429_is_insufficient_quota(quota_store: QuotaStore) -> None:
    limits = QuotaLimits(monthly_token_budget=1_000_000)
    await quota_store.reserve("t", limits, 999_000, "r1")
    error = quota_exceeded(await quota_store.reserve("t", limits, 2000, "r2"), 2000)
    assert (error.code, error.type) == ("insufficient_quota", "insufficient_quota")
    assert error.message == (
        "Monthly token budget exhausted (the tenant's limit): limit 1,000,000, used 999,000, remaining 1,000, "
        f"requested 2,000; resets in {MONTH_RESETS}"
    )


def test_never_fits_names_the_limit_and_the_field_to_lower() -> None:
    limits = QuotaLimits(tokens_per_minute=2000, monthly_token_budget=5000, max_concurrent_requests=4)
    assert never_fits(limits, 2000, 4) is None  # exactly at every limit: fits once the windows are empty
    assert never_fits(QuotaLimits(), 10**12, 10**6) is None  # unlimited
    cases = [
        (limits, 2001, 1, "max_tokens", "tokens_per_minute limit is 2,000", "reserves 2,001 tokens"),
        (QuotaLimits(monthly_token_budget=5000), 5001, 1, "max_tokens", "monthly_token_budget is 5,000", "5,001"),
        (limits, 10, 5, "n", "max_concurrent_requests limit is 4", "runs 5 sequences at once"),
    ]
    for case_limits, tokens, slots, param, limit_text, size_text in cases:
        error = never_fits(case_limits, tokens, slots)
        assert error is not None
        assert (error.status_code, error.code, error.param) == (400, "request_exceeds_limit", param)
        assert limit_text in error.message and size_text in error.message
