"""Tenant weights (scheduling tiers): stored, bounded to (0, 100] over HTTP, in the service and the CLI, and
carried by the principal of every key of the tenant."""

from __future__ import annotations

import math
import secrets

import pytest
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.db.database import Database
from pagewise.platform.errors import APIError
from pagewise.platform.keys.auth import authenticate
from pagewise.platform.keys.schemas import KeyCreate
from pagewise.platform.keys.service import KeyService
from pagewise.platform.tenants.schemas import TenantCreate, TenantUpdate
from pagewise.platform.tenants.service import TenantService

from ..harness import Platform, bearer

BAD_JSON_WEIGHTS = ["0", "-1", "101", "-0.0", "null", '"2"', "true"]
BAD_WEIGHTS = [0.0, -1.0, 101.0, math.inf, math.nan, None]


@pytest.mark.anyio
async def test_weight_defaults_to_1_and_round_trips_over_http(platform: Platform) -> None:
    admin = bearer(platform.admin_key)
    assert (await platform.create_tenant())["weight"] == 1.0
    tenant = await platform.create_tenant(weight=2.5)
    assert tenant["weight"] == 2.5
    assert (await platform.http.get(f"/admin/tenants/{tenant['id']}", headers=admin)).json() == tenant
    patched = await platform.http.patch(f"/admin/tenants/{tenant['id']}", json={"weight": 100}, headers=admin)
    assert patched.status_code == 200 and patched.json()["weight"] == 100.0
    other = await platform.http.patch(f"/admin/tenants/{tenant['id']}", json={"max_n": 2}, headers=admin)
    assert other.json()["weight"] == 100.0  # an absent weight is left alone
    tiny = await platform.http.patch(f"/admin/tenants/{tenant['id']}", json={"weight": 1e-3}, headers=admin)
    assert tiny.json()["weight"] == 1e-3
    listed = (await platform.http.get("/admin/tenants", headers=admin)).json()
    assert next(t for t in listed if t["id"] == tenant["id"])["weight"] == 1e-3


@pytest.mark.anyio
@pytest.mark.parametrize("raw", BAD_JSON_WEIGHTS)
async def test_bad_weights_are_400_naming_weight_and_change_nothing(platform: Platform, raw: str) -> None:
    headers = bearer(platform.admin_key) | {"Content-Type": "application/json"}
    tenant = await platform.create_tenant(weight=3)
    name = f"tenant-{secrets.token_hex(4)}"
    created = await platform.http.post(
        "/admin/tenants", content=f'{{"name": "{name}", "weight": {raw}}}', headers=headers
    )
    assert created.status_code == 400 and created.json()["error"]["param"] == "weight", created.text
    patched = await platform.http.patch(
        f"/admin/tenants/{tenant['id']}", content=f'{{"weight": {raw}}}', headers=headers
    )
    assert patched.status_code == 400 and patched.json()["error"]["param"] == "weight", patched.text
    listed = (await platform.http.get("/admin/tenants", headers=headers)).json()
    assert name not in {t["name"] for t in listed}
    assert (await platform.http.get(f"/admin/tenants/{tenant['id']}", headers=headers)).json() == tenant


@pytest.mark.anyio
async def test_an_infinite_weight_never_reaches_the_body(platform: Platform) -> None:
    """JSON has no infinity: `1e999` overflows, and the JSON decoder refuses the whole body with a 400."""
    headers = bearer(platform.admin_key) | {"Content-Type": "application/json"}
    tenant = await platform.create_tenant(weight=3)
    name = f"tenant-{secrets.token_hex(4)}"
    created = await platform.http.post(
        "/admin/tenants", content=f'{{"name": "{name}", "weight": 1e999}}', headers=headers
    )
    patched = await platform.http.patch(f"/admin/tenants/{tenant['id']}", content='{"weight": 1e999}', headers=headers)
    for refused in (created, patched):
        assert refused.status_code == 400 and "Number out of range" in refused.json()["error"]["message"]
    listed = (await platform.http.get("/admin/tenants", headers=headers)).json()
    assert name not in {t["name"] for t in listed}
    assert (await platform.http.get(f"/admin/tenants/{tenant['id']}", headers=headers)).json() == tenant


@pytest.mark.anyio
async def test_the_service_bounds_weights_for_the_cli(session: AsyncSession) -> None:
    service = TenantService(session)
    tenant = await service.create(TenantCreate(name=f"weighted-{secrets.token_hex(4)}", weight=4.0))
    refused_names = [f"bad-{secrets.token_hex(4)}" for _ in BAD_WEIGHTS]
    for weight, name in zip(BAD_WEIGHTS, refused_names, strict=True):
        with pytest.raises(APIError) as refused_create:
            await service.create(TenantCreate(name=name, weight=weight))
        with pytest.raises(APIError) as refused_update:
            await service.update(tenant.id, TenantUpdate(weight=weight, max_n=1))
        for refused in (refused_create.value, refused_update.value):
            assert (refused.status_code, refused.param) == (400, "weight")
            assert refused.message == f"weight must be a finite number above 0 and at most 100; got {weight!r}"
    await session.refresh(tenant)
    assert (tenant.weight, tenant.max_n) == (4.0, 8)
    assert not {t.name for t in await service.list()} & set(refused_names)
    assert (await service.update(tenant.id, TenantUpdate(weight=100.0))).weight == 100.0


@pytest.mark.anyio
async def test_the_principal_carries_the_tenants_weight(session: AsyncSession, database: Database) -> None:
    tenants = TenantService(session)
    tenant = await tenants.create(TenantCreate(name=f"tier-{secrets.token_hex(4)}", weight=2.0))
    key = (await KeyService(session).create(tenant.id, KeyCreate())).key
    principal = await authenticate(database, f"Bearer {key}")
    assert (principal.tenant_id, principal.weight) == (tenant.id, 2.0)
    await tenants.update(tenant.id, TenantUpdate(weight=0.5))
    assert (await authenticate(database, f"Bearer {key}")).weight == 0.5


def test_cli_create_update_and_list_weights(cli) -> None:
    name = f"cli-{secrets.token_hex(4)}"
    code, out, _ = cli("tenants", "create", name, "--weight", "2.5", "--rpm", "10")
    assert code == 0 and "  weight=2.5  " in out[0] and "requests_per_minute=10" in out[0]
    code, out, _ = cli("tenants", "update", name, "--weight", "10")
    assert code == 0 and "  weight=10  " in out[0] and "requests_per_minute=10" in out[0]
    code, out, _ = cli("tenants", "update", name, "--rpm", "20")
    assert code == 0 and "  weight=10  " in out[0]
    default = f"cli-{secrets.token_hex(4)}"
    assert cli("tenants", "create", default)[0] == 0
    code, lines, _ = cli("tenants", "list")
    listed = {line.split()[1]: line for line in lines}
    assert code == 0 and "  weight=10  " in listed[name] and "  weight=1  " in listed[default]


@pytest.mark.parametrize("weight", ["0", "-1", "101", "inf", "nan"])
def test_cli_bad_weights_are_one_line_errors(cli, weight: str) -> None:
    name = f"cli-{secrets.token_hex(4)}"
    code, out, err = cli("tenants", "create", name, f"--weight={weight}")
    assert (code, out, len(err)) == (1, [], 1) and err[0].startswith("error: weight must be a finite number")
    assert cli("tenants", "create", name, "--weight", "3")[0] == 0
    code, out, err = cli("tenants", "update", name, f"--weight={weight}")
    assert (code, out, len(err)) == (1, [], 1) and err[0].startswith("error: weight must be a finite number")
    assert "  weight=3  " in next(line for line in cli("tenants", "list")[1] if f"  {name}  " in line)
