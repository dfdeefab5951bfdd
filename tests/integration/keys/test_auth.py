"""Keys and auth: 401 for missing/invalid/revoked/expired keys; 403 for suspended tenants, missing scopes."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import update

from pagewise.platform.db.models import ApiKey

from ..harness import Platform, bearer

pytestmark = pytest.mark.anyio


async def _models(platform: Platform, headers: dict[str, str]) -> tuple[int, dict]:
    response = await platform.http.get("/v1/models", headers=headers)
    return response.status_code, response.json()


async def test_missing_malformed_and_wrong_keys_are_401(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    prefix = key.split("_")[1]
    for headers in (
        {},
        {"Authorization": "Basic abc"},
        bearer("sk-notours"),
        bearer(f"pw_{prefix}_wrongsecret"),
    ):
        status, body = await _models(platform, headers)
        assert status == 401
        assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == "invalid_api_key"
    assert (await _models(platform, bearer(key)))[0] == 200


async def test_revoked_and_expired_keys_are_401(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key()
    keys = (
        await platform.http.get(f"/admin/tenants/{tenant['id']}/keys", headers=bearer(platform.admin_key))
    ).json()
    assert len(keys) == 1 and "key" not in keys[0] and "secret_sha256" not in keys[0]
    revoked = await platform.http.delete(
        f"/admin/tenants/{tenant['id']}/keys/{keys[0]['id']}", headers=bearer(platform.admin_key)
    )
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert (await _models(platform, bearer(key)))[0] == 401

    expiring = await platform.create_key(tenant["id"])
    async with platform.services.sessionmaker() as session:
        past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        await session.execute(
            update(ApiKey).where(ApiKey.prefix == expiring.split("_")[1]).values(expires_at=past)
        )
        await session.commit()
    status, body = await _models(platform, bearer(expiring))
    assert status == 401 and "expired" in body["error"]["message"]


async def test_rotate_issues_a_new_key_and_revokes_the_old(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key()
    [listed] = (
        await platform.http.get(f"/admin/tenants/{tenant['id']}/keys", headers=bearer(platform.admin_key))
    ).json()
    rotated = await platform.http.post(
        f"/admin/tenants/{tenant['id']}/keys/{listed['id']}/rotate", headers=bearer(platform.admin_key)
    )
    assert rotated.status_code == 201
    assert (await _models(platform, bearer(key)))[0] == 401
    assert (await _models(platform, bearer(rotated.json()["key"])))[0] == 200


async def test_suspended_tenant_is_403(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key()
    suspended = await platform.http.post(
        f"/admin/tenants/{tenant['id']}/suspend", headers=bearer(platform.admin_key)
    )
    assert suspended.json()["status"] == "suspended"
    status, body = await _models(platform, bearer(key))
    assert status == 403 and body["error"]["code"] == "tenant_suspended"
    await platform.http.patch(
        f"/admin/tenants/{tenant['id']}", json={"status": "active"}, headers=bearer(platform.admin_key)
    )
    assert (await _models(platform, bearer(key)))[0] == 200


async def test_admin_routes_need_the_admin_scope(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    for path in ("/admin/tenants", "/admin/usage", "/admin/requests", "/admin/engine", "/admin/overview"):
        response = await platform.http.get(path, headers=bearer(key))
        assert response.status_code == 403, path
        assert response.json()["error"]["code"] == "insufficient_scope"
        assert (await platform.http.get(path, headers=bearer(platform.admin_key))).status_code == 200, path


async def test_tenant_admin_crud_and_errors(platform: Platform) -> None:
    admin = bearer(platform.admin_key)
    tenant = await platform.create_tenant(max_concurrent_requests=3, monthly_token_budget=None)
    assert tenant["max_concurrent_requests"] == 3 and tenant["monthly_token_budget"] is None
    duplicate = await platform.http.post("/admin/tenants", json={"name": tenant["name"]}, headers=admin)
    assert duplicate.status_code == 409 and duplicate.json()["error"]["code"] == "tenant_exists"
    updated = await platform.http.patch(
        f"/admin/tenants/{tenant['id']}", json={"tokens_per_minute": 77}, headers=admin
    )
    assert updated.json()["tokens_per_minute"] == 77 and updated.json()["max_concurrent_requests"] == 3
    bad = await platform.http.patch(f"/admin/tenants/{tenant['id']}", json={"max_n": 0}, headers=admin)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_n"
    missing = await platform.http.get("/admin/tenants/ten_nope", headers=admin)
    assert missing.status_code == 404
    listed = (await platform.http.get("/admin/tenants", headers=admin)).json()
    assert tenant["id"] in {t["id"] for t in listed}
