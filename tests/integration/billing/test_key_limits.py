"""Per-key limits on top of the tenant's, enforced at admission: a 429 names the key's limit, a model the key may
not use is a 403 naming `model` and is not listed by `/v1/models`, limits change with `PATCH` and survive
rotation; a small dollar budget is never overspent by concurrent requests, and its counter settles to the bills."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.db.models import ApiKey, RequestRecord

from ..harness import MODEL, Platform, bearer, chat_body
from .prices import ensure_price, micros

pytestmark = pytest.mark.anyio


async def _key(platform: Platform, tenant_id: str, **limits) -> dict:
    response = await platform.http.post(
        f"/admin/tenants/{tenant_id}/keys", json=limits, headers=bearer(platform.admin_key)
    )
    assert response.status_code == 201, response.text
    return response.json()


async def _chat(platform: Platform, key: str, **extra):
    return await platform.http.post("/v1/chat/completions", json=chat_body(**extra), headers=bearer(key))


async def test_a_keys_rate_limit_is_its_own_and_named(platform: Platform) -> None:
    tenant = await platform.create_tenant()
    limited = await _key(platform, tenant["id"], requests_per_minute=1)
    assert limited["requests_per_minute"] == 1 and limited["allowed_models"] is None
    other = await platform.create_key(tenant["id"])
    assert (await _chat(platform, limited["key"])).status_code == 200
    refused = await _chat(platform, limited["key"])
    assert refused.status_code == 429
    assert refused.json()["error"]["message"].startswith(
        "Rate limit reached for requests per minute (this API key's limit): limit 1, used 1, remaining 0"
    )
    assert refused.headers["x-ratelimit-limit-requests"] == "1"
    assert (await _chat(platform, other)).status_code == 200  # the tenant's other key is not limited

    admin = bearer(platform.admin_key)
    patched = await platform.http.patch(
        f"/admin/tenants/{tenant['id']}/keys/{limited['id']}", json={"requests_per_minute": None}, headers=admin
    )
    assert patched.status_code == 200 and patched.json()["requests_per_minute"] is None
    assert (await _chat(platform, limited["key"])).status_code == 200


async def test_allowed_models_refuse_others_with_a_403_naming_model(platform: Platform) -> None:
    tenant = await platform.create_tenant()
    key = await _key(platform, tenant["id"], allowed_models=["another-model", " another-model "])
    assert key["allowed_models"] == ["another-model"]
    refused = await _chat(platform, key["key"])
    error = refused.json()["error"]
    assert (refused.status_code, error["code"], error["param"]) == (403, "model_not_allowed", "model")
    assert MODEL in error["message"]
    admin = bearer(platform.admin_key)
    rotated = await platform.http.post(f"/admin/tenants/{tenant['id']}/keys/{key['id']}/rotate", headers=admin)
    assert rotated.json()["allowed_models"] == ["another-model"]  # rotation keeps the limits
    await platform.http.patch(
        f"/admin/tenants/{tenant['id']}/keys/{rotated.json()['id']}",
        json={"allowed_models": ["another-model", MODEL]},
        headers=admin,
    )
    assert (await _chat(platform, rotated.json()["key"])).status_code == 200


async def test_models_lists_only_what_the_key_may_use(platform: Platform) -> None:
    tenant = await platform.create_tenant()
    restricted = await _key(platform, tenant["id"], allowed_models=["another-model"])
    allowed = await _key(platform, tenant["id"], allowed_models=["another-model", MODEL])
    unrestricted = await platform.create_key(tenant["id"])

    async def models(key: str) -> tuple[list[str], int]:
        listed = await platform.http.get("/v1/models", headers=bearer(key))
        assert listed.status_code == 200, listed.text
        one = await platform.http.get(f"/v1/models/{MODEL}", headers=bearer(key))
        return [m["id"] for m in listed.json()["data"]], one.status_code

    assert await models(restricted["key"]) == ([], 404)  # "another-model" is allowed but not served
    assert await models(allowed["key"]) == ([MODEL], 200)
    assert await models(unrestricted) == ([MODEL], 200)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"allowed_models": []}, "allowed_models"),
        ({"allowed_models": ["\n"]}, "allowed_models"),
        ({"requests_per_minute": -1}, "requests_per_minute"),
        ({"monthly_spend_budget_micros": "5"}, "monthly_spend_budget_micros"),
        ({"max_concurrent_requests": 2}, "max_concurrent_requests"),
    ],
)
async def test_bad_limits_are_400s_and_write_nothing(
    platform: Platform, session: AsyncSession, body: dict, param: str
) -> None:
    tenant = await platform.create_tenant()
    admin = bearer(platform.admin_key)
    response = await platform.http.post(f"/admin/tenants/{tenant['id']}/keys", json=body, headers=admin)
    assert (response.status_code, response.json()["error"]["param"]) == (400, param), response.text
    count = select(func.count()).select_from(ApiKey).where(ApiKey.tenant_id == tenant["id"])
    assert await session.scalar(count) == 0
    key = await _key(platform, tenant["id"])
    patched = await platform.http.patch(f"/admin/tenants/{tenant['id']}/keys/{key['id']}", json=body, headers=admin)
    assert (patched.status_code, patched.json()["error"]["param"]) == (400, param), patched.text


async def test_concurrent_requests_never_overspend_a_small_dollar_budget(
    platform: Platform, session: AsyncSession
) -> None:
    price = await ensure_price(platform)
    probe_tenant, probe = await platform.tenant_with_key()
    assert (await _chat(platform, probe, max_tokens=8)).status_code == 200
    prompt_tokens = await session.scalar(
        select(RequestRecord.prompt_tokens).where(RequestRecord.tenant_id == probe_tenant["id"])
    )
    reserved = (prompt_tokens * micros(price, "input") + 8 * micros(price, "output")) // 10**6
    budget = 2 * reserved + reserved // 2  # two reservations fit at a time, never three
    tenant = await platform.create_tenant(monthly_spend_budget_micros=budget)
    key = await platform.create_key(tenant["id"])
    responses = await asyncio.gather(*(_chat(platform, key, max_tokens=8) for _ in range(8)))
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) >= 2 and 429 in statuses, statuses
    refusal = next(r for r in responses if r.status_code == 429).json()["error"]
    assert refusal["code"] == "insufficient_quota" and refusal["message"].startswith("Monthly spend budget exhausted")
    spent = await session.scalar(
        select(func.sum(RequestRecord.cost_micros)).where(RequestRecord.tenant_id == tenant["id"])
    )
    assert 0 < spent <= budget
    assert (await platform.services.quotas.usage(tenant["id"])).spend_this_month == spent  # settled to the bills
