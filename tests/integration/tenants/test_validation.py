"""Tenant bodies are strict and bounded, over HTTP and through the service the CLI uses; a refused create
or update changes nothing."""

from __future__ import annotations

import re

import pytest
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.errors import APIError
from pagewise.platform.tenants.schemas import INT32_MAX, INT64_MAX, TenantCreate, TenantUpdate
from pagewise.platform.tenants.service import TenantService

from ..harness import Platform, bearer

pytestmark = pytest.mark.anyio

BAD_NAMES = [
    ("", "must not be empty"),
    ("   ", "must not be empty"),
    ("x" * 201, "at most 200 characters; got 201"),
    ("a\x00b", "control character; found U+0000 at position 1"),
    ("two\nlines", "control character; found U+000A at position 3"),
    ("bell\x07", "control character; found U+0007"),
]


async def test_unknown_fields_are_400_naming_them(platform: Platform) -> None:
    admin = bearer(platform.admin_key)
    tenant = await platform.create_tenant(requests_per_minute=5)
    created = await platform.http.post("/admin/tenants", json={"name": "typo-tenant", "rpm": 10}, headers=admin)
    assert created.status_code == 400 and "rpm" in created.json()["error"]["message"]
    patched = await platform.http.patch(f"/admin/tenants/{tenant['id']}", json={"rpm": 10}, headers=admin)
    assert patched.status_code == 400 and "rpm" in patched.json()["error"]["message"]
    unchanged = (await platform.http.get(f"/admin/tenants/{tenant['id']}", headers=admin)).json()
    assert unchanged == tenant


async def test_names_are_checked_and_stripped_over_http(platform: Platform) -> None:
    admin = bearer(platform.admin_key)
    tenant = await platform.create_tenant()
    for name, message in BAD_NAMES:
        created = await platform.http.post("/admin/tenants", json={"name": name}, headers=admin)
        assert created.status_code == 400, name
        assert created.json()["error"]["param"] == "name" and message in created.json()["error"]["message"]
        patched = await platform.http.patch(f"/admin/tenants/{tenant['id']}", json={"name": name}, headers=admin)
        assert patched.status_code == 400 and patched.json()["error"]["param"] == "name"
    assert (await platform.http.get(f"/admin/tenants/{tenant['id']}", headers=admin)).json() == tenant
    longest = tenant["name"] + "é" * (200 - len(tenant["name"]))
    renamed = await platform.http.patch(
        f"/admin/tenants/{tenant['id']}", json={"name": f"  {longest}\t"}, headers=admin
    )
    assert renamed.status_code == 200 and renamed.json()["name"] == longest


@pytest.mark.parametrize(
    ("field", "too_big", "largest"),
    [
        ("requests_per_minute", INT32_MAX + 1, INT32_MAX),
        ("tokens_per_minute", INT32_MAX + 1, INT32_MAX),
        ("max_concurrent_requests", INT32_MAX + 1, INT32_MAX),
        ("max_tokens_per_request", INT32_MAX + 1, INT32_MAX),
        ("max_n", INT32_MAX + 1, INT32_MAX),
        ("monthly_token_budget", INT64_MAX + 1, INT64_MAX),
    ],
)
async def test_quotas_are_bounded_by_their_columns(
    platform: Platform, field: str, too_big: int, largest: int
) -> None:
    admin = bearer(platform.admin_key)
    tenant = await platform.create_tenant()
    refused = await platform.http.patch(f"/admin/tenants/{tenant['id']}", json={field: too_big}, headers=admin)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == field
    negative = await platform.http.patch(f"/admin/tenants/{tenant['id']}", json={field: -1}, headers=admin)
    assert negative.status_code == 400 and negative.json()["error"]["param"] == field
    stored = await platform.http.patch(f"/admin/tenants/{tenant['id']}", json={field: largest}, headers=admin)
    assert stored.status_code == 200 and stored.json()[field] == largest
    assert (await platform.http.get(f"/admin/tenants/{tenant['id']}", headers=admin)).json()[field] == largest


async def test_the_service_applies_the_same_rules_for_the_cli(session: AsyncSession) -> None:
    service = TenantService(session)
    for name, message in BAD_NAMES:
        with pytest.raises(APIError, match=re.escape(message)) as refused:
            await service.create(TenantCreate(name=name))
        assert (refused.value.status_code, refused.value.param) == (400, "name")
    with pytest.raises(APIError) as too_big:
        await service.create(TenantCreate(name="cli-big", requests_per_minute=INT32_MAX + 1))
    assert too_big.value.param == "requests_per_minute"
    assert too_big.value.message == (
        "requests_per_minute must be between 0 and 2,147,483,647 (or null for no limit); got 2,147,483,648"
    )
    tenant = await service.create(TenantCreate(name=" cli-tenant-ok ", monthly_token_budget=INT64_MAX))
    assert tenant.name == "cli-tenant-ok"
    with pytest.raises(APIError) as zero:
        await service.update(tenant.id, TenantUpdate(max_n=0, requests_per_minute=1))
    assert zero.value.param == "max_n"
    with pytest.raises(APIError):
        await service.update(tenant.id, TenantUpdate(name="bad\x1b[31m"))
    await session.refresh(tenant)
    assert (tenant.name, tenant.max_n, tenant.requests_per_minute) == ("cli-tenant-ok", 8, 600)
    assert {t.name for t in await service.list()} >= {"cli-tenant-ok"}
    assert not {t.name for t in await service.list()} & {"cli-big", ""}
