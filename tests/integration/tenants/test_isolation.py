"""Tenant isolation: ids are 404 across tenants; the prefix cache is shared within a tenant, never across."""

from __future__ import annotations

import pytest

from ..harness import MODEL, Platform, bearer

pytestmark = pytest.mark.anyio

# long enough to fill several KV blocks, so a prefix hit is visible in cached_tokens
SHARED_PROMPT = "You are a careful assistant. " * 12 + "Name three colours."


async def test_request_ids_are_404_across_tenants(platform: Platform) -> None:
    _, key_a = await platform.tenant_with_key()
    _, key_b = await platform.tenant_with_key()
    body = {"endpoint": "/v1/completions", "model": MODEL, "prompt": "Hello", "max_tokens": 1}
    created = (await platform.http.post("/v1/requests", json=body, headers=bearer(key_a))).json()
    request_id = created["id"]
    for method in ("GET", "DELETE"):
        response = await platform.http.request(method, f"/v1/requests/{request_id}", headers=bearer(key_b))
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
        missing = await platform.http.request(method, "/v1/requests/cmpl_doesnotexist", headers=bearer(key_b))
        assert missing.json() == {
            **response.json(),
            "error": {**response.json()["error"], "message": missing.json()["error"]["message"]},
        }
    listed_b = (await platform.http.get("/v1/requests", headers=bearer(key_b))).json()
    assert listed_b["data"] == []
    assert (await platform.http.get(f"/v1/requests/{request_id}", headers=bearer(key_a))).status_code == 200


async def test_prefix_cache_is_shared_within_a_tenant_only(platform: Platform) -> None:
    _, key_a = await platform.tenant_with_key()
    _, key_b = await platform.tenant_with_key()
    body = {"model": MODEL, "prompt": SHARED_PROMPT, "max_tokens": 1, "temperature": 0}

    async def cached(key: str) -> int:
        response = await platform.http.post("/v1/completions", json=body, headers=bearer(key))
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert await cached(key_a) == 0
    assert await cached(key_a) > 0  # same tenant: prefix hit
    assert await cached(key_b) == 0  # other tenant: same prompt, no hit


async def test_body_cannot_choose_the_tenant(platform: Platform) -> None:
    tenant_a, key_a = await platform.tenant_with_key()
    _, key_b = await platform.tenant_with_key()
    body = {"model": MODEL, "prompt": SHARED_PROMPT + " Again.", "max_tokens": 1, "temperature": 0}
    await platform.http.post("/v1/completions", json=body, headers=bearer(key_a))
    refused = await platform.http.post(
        "/v1/completions", json={**body, "tenant_id": tenant_a["id"]}, headers=bearer(key_b)
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tenant_id"
    spoofed = {**body, "user": tenant_a["id"]}
    response = (await platform.http.post("/v1/completions", json=spoofed, headers=bearer(key_b))).json()
    assert response["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
