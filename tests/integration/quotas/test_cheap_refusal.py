"""The cheap pre-check, on both stores: before a request is tokenized, the tenant's concurrency and request rate and
then the key's request rate are checked on the counters as they are; the 429 names whose limit and which one."""

from __future__ import annotations

from typing import Any

import pytest

from pagewise.platform.quotas.admission import cheap_refusal
from pagewise.platform.quotas.headers import quota_exceeded
from pagewise.platform.quotas.quota_store import KeyQuota, QuotaLimits, QuotaStore

from ..harness import MODEL, Platform, bearer

pytestmark = pytest.mark.anyio


@pytest.fixture
def platform_quota_store(quota_store: QuotaStore) -> QuotaStore:
    return quota_store


async def test_the_tenant_then_the_key_and_the_refusal_names_which(quota_store: QuotaStore) -> None:
    tenant = QuotaLimits(requests_per_minute=3, max_concurrent_requests=2)
    key_a = KeyQuota("key_a", QuotaLimits(requests_per_minute=1, tokens_per_minute=10))
    key_b = KeyQuota("key_b", QuotaLimits(requests_per_minute=1))
    assert await cheap_refusal(quota_store, "t", tenant, key_a) is None
    assert (await quota_store.reserve("t", tenant, 5, "r1", key=key_a)).reservation is not None

    refused = await cheap_refusal(quota_store, "t", tenant, key_a)
    assert refused is not None and (refused.rejected_by, refused.scope) == ("requests", "key")
    assert quota_exceeded(refused, 0).message.startswith(
        "Rate limit reached for requests per minute (this API key's limit): limit 1, used 1, remaining 0"
    )
    assert await cheap_refusal(quota_store, "t", tenant, key_b) is None  # another key counts its own requests

    assert (await quota_store.reserve("t", tenant, 5, "r2", key=key_b)).reservation is not None
    refused = await cheap_refusal(quota_store, "t", tenant, key_b)  # key_b is at its rate too: the tenant comes first
    assert refused is not None and (refused.rejected_by, refused.scope) == ("concurrency", "tenant")
    assert quota_exceeded(refused, 0).message.startswith(
        "Concurrency limit reached (the tenant's limit): limit 2, in use 2, requested 1"
    )
    # token limits need the request's token count: they are left to the reservation
    assert await cheap_refusal(quota_store, "t", QuotaLimits(tokens_per_minute=1), None) is None


def _huge() -> dict[str, Any]:
    return {"model": MODEL, "prompt": "word " * 150_000, "max_tokens": 2}


async def test_a_key_at_its_rate_is_refused_before_tokenizing(
    platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant = await platform.create_tenant()
    created = await platform.http.post(
        f"/admin/tenants/{tenant['id']}/keys", json={"requests_per_minute": 1}, headers=bearer(platform.admin_key)
    )
    key = created.json()["key"]
    small = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    assert (await platform.http.post("/v1/completions", json=small, headers=bearer(key))).status_code == 200
    encoded: list[int] = []
    real_encode = platform.services.engine.encode
    monkeypatch.setattr(platform.services.engine, "encode", lambda text: encoded.append(len(text)) or real_encode(text))
    refused = await platform.http.post("/v1/completions", json=_huge(), headers=bearer(key))
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["message"].startswith(
        "Rate limit reached for requests per minute (this API key's limit): limit 1, used 1, remaining 0"
    )
    assert refused.headers["x-ratelimit-limit-requests"] == "1" and int(refused.headers["retry-after"]) >= 1
    assert encoded == []  # refused on a counter read: the prompt was never tokenized
    other = await platform.create_key(tenant["id"])
    assert (await platform.http.post("/v1/completions", json=small, headers=bearer(other))).status_code == 200
    assert encoded != []
