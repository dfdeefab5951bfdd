"""Quotas through the API, on both stores: exactly the allowed requests succeed, the rest get 429 with
headers, and every counter returns to zero once everything has finished or been cancelled."""

from __future__ import annotations

import asyncio

import pytest

from pagewise.platform.quotas.quota_store import QuotaStore

from ..harness import MODEL, Platform, bearer

pytestmark = pytest.mark.anyio

PROMPT_IDS = list(range(1000, 1012))  # 12 prompt tokens
MAX_TOKENS = 2
COST = len(PROMPT_IDS) + MAX_TOKENS  # reserved and (with ignore_eos) billed per request


@pytest.fixture
def platform_quota_store(quota_store: QuotaStore) -> QuotaStore:
    return quota_store


async def test_32_concurrent_against_10_allowed(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key(
        max_concurrent_requests=10, tokens_per_minute=10 * COST, requests_per_minute=1000
    )
    body = {
        "model": MODEL,
        "prompt": PROMPT_IDS,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
    }
    responses = await asyncio.gather(
        *(platform.http.post("/v1/completions", json=body, headers=bearer(key)) for _ in range(32))
    )
    ok = [r for r in responses if r.status_code == 200]
    limited = [r for r in responses if r.status_code == 429]
    assert (len(ok), len(limited)) == (10, 22)
    for response in limited:
        error = response.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert int(response.headers["retry-after"]) >= 1
        for name in (
            "limit-requests",
            "remaining-requests",
            "limit-tokens",
            "remaining-tokens",
            "reset-requests",
            "reset-tokens",
        ):
            assert f"x-ratelimit-{name}" in response.headers
    assert all(r.json()["usage"]["total_tokens"] == COST for r in ok)
    usage = await platform.services.quotas.usage(tenant["id"])
    assert (usage.concurrent, usage.outstanding) == (0, 0)
    assert usage.tokens_this_minute == 10 * COST


async def test_monthly_budget_is_insufficient_quota(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key(monthly_token_budget=COST)
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    assert (await platform.http.post("/v1/completions", json=body, headers=bearer(key))).status_code == 200
    refused = await platform.http.post("/v1/completions", json=body, headers=bearer(key))
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "insufficient_quota"
    assert int(refused.headers["retry-after"]) > 60


async def test_unused_reservation_is_refunded(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key(tokens_per_minute=1000)
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 8, "stop": [" "], "temperature": 0}
    result = (await platform.http.post("/v1/completions", json=body, headers=bearer(key))).json()
    usage = await platform.services.quotas.usage(tenant["id"])
    assert usage.tokens_this_minute == result["usage"]["total_tokens"]
    assert usage.concurrent == 0


async def test_a_request_no_window_could_admit_is_400_and_reserves_nothing(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key(tokens_per_minute=COST - 1, max_concurrent_requests=2)
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS}
    too_long = await platform.http.post("/v1/completions", json=body, headers=bearer(key))
    assert too_long.status_code == 400
    error = too_long.json()["error"]
    assert (error["code"], error["param"]) == ("request_exceeds_limit", "max_tokens")
    assert f"reserves {COST} tokens" in error["message"] and f"limit is {COST - 1}" in error["message"]
    too_wide = await platform.http.post(
        "/v1/completions", json={**body, "max_tokens": 1, "n": 3}, headers=bearer(key)
    )
    assert too_wide.status_code == 400
    assert (too_wide.json()["error"]["code"], too_wide.json()["error"]["param"]) == ("request_exceeds_limit", "n")
    usage = await platform.services.quotas.usage(tenant["id"])
    assert (usage.requests_this_minute, usage.tokens_this_minute, usage.concurrent) == (0, 0, 0)
