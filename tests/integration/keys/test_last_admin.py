"""Some active tenant always keeps an active admin key: suspending its tenant or revoking it is a 409
`last_admin` that changes nothing — through the service (the CLI's path) and over HTTP."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable

import httpx
import pytest
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from pagewise.engine.async_engine import AsyncLLMEngine
from pagewise.platform.app import create_app
from pagewise.platform.db.models import ApiKey, Tenant
from pagewise.platform.errors import APIError
from pagewise.platform.keys.schemas import KeyCreate
from pagewise.platform.keys.service import KeyService
from pagewise.platform.quotas.memory_store import InProcessQuotaStore
from pagewise.platform.settings import Settings
from pagewise.platform.tenants.last_admin import ensure_admin_remains
from pagewise.platform.tenants.schemas import TenantCreate, TenantUpdate
from pagewise.platform.tenants.service import TenantService

from ..harness import bearer

pytestmark = pytest.mark.anyio

SUSPEND = TenantUpdate(status="suspended")


async def _refused(call: Awaitable[object]) -> None:
    with pytest.raises(APIError) as refused:
        await call
    assert (refused.value.status_code, refused.value.code) == (409, "last_admin")


async def test_the_last_admin_tenant_and_key_are_protected(empty_db: async_sessionmaker[AsyncSession]) -> None:
    async with empty_db() as session:
        tenants, keys = TenantService(session), KeyService(session)
        first = await keys.bootstrap_admin()
        assert first is not None
        admin = first.tenant_id
        await _refused(tenants.update(admin, SUSPEND))
        await _refused(keys.revoke(admin, first.id))

        other = await tenants.create(TenantCreate(name="ops"))
        await keys.create(other.id, KeyCreate(scopes=["inference"]))  # not an admin key
        expired = await keys.create(other.id, KeyCreate(scopes=["admin"]))
        await session.execute(
            update(ApiKey)
            .where(ApiKey.id == expired.id)
            .values(expires_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1))
        )
        await session.commit()
        await _refused(tenants.update(admin, SUSPEND))  # an expired admin key does not count

        second = await keys.create(admin, KeyCreate(scopes=["admin"]))
        assert (await keys.revoke(admin, first.id)).revoked_at is not None  # the tenant keeps `second`
        await _refused(tenants.update(admin, SUSPEND))
        await _refused(keys.revoke(admin, second.id))
        rotated = await keys.rotate(admin, second.id)  # replaced, not lost
        await _refused(keys.revoke(admin, rotated.id))

        other_admin = await keys.create(other.id, KeyCreate(scopes=["admin"]))
        assert (await tenants.update(admin, SUSPEND)).status == "suspended"
        await _refused(tenants.update(other.id, SUSPEND))  # now `ops` holds the last working admin key
        await _refused(keys.revoke(other.id, other_admin.id))
        await tenants.update(admin, TenantUpdate(status="active"))
        assert (await keys.revoke(other.id, other_admin.id)).revoked_at is not None


async def test_without_any_working_admin_key_nothing_is_refused(empty_db: async_sessionmaker[AsyncSession]) -> None:
    """A database that already lost every admin key can still be managed (from the CLI)."""
    async with empty_db() as session:
        tenants, keys = TenantService(session), KeyService(session)
        first = await keys.bootstrap_admin()
        assert first is not None
        await keys.create(first.tenant_id, KeyCreate(scopes=["admin"]))
        await keys.revoke(first.tenant_id, first.id)
        await session.execute(update(ApiKey).values(expires_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)))
        await session.commit()
        assert (await tenants.update(first.tenant_id, SUSPEND)).status == "suspended"


async def test_over_http_the_refusal_is_a_409_and_changes_nothing(
    empty_database_url: str, empty_db: async_sessionmaker[AsyncSession], llm_engine: AsyncLLMEngine
) -> None:
    async with empty_db() as session:
        first = await KeyService(session).bootstrap_admin()
    assert first is not None
    settings = Settings.from_env({}, database_url=empty_database_url, auto_migrate=False)
    app = create_app(settings, engine=llm_engine, quotas=InProcessQuotaStore())
    async with app.lifespan():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            admin, tenant = bearer(first.key), f"/admin/tenants/{first.tenant_id}"
            for response in (
                await http.patch(tenant, json={"status": "suspended"}, headers=admin),
                await http.post(f"{tenant}/suspend", headers=admin),
                await http.delete(f"{tenant}/keys/{first.id}", headers=admin),
            ):
                assert response.status_code == 409
                error = response.json()["error"]
                assert (error["code"], error["type"]) == ("last_admin", "conflict_error")
                assert "locking every administrator out" in error["message"]
            assert (await http.get(tenant, headers=admin)).json()["status"] == "active"
            [key] = (await http.get(f"{tenant}/keys", headers=admin)).json()
            assert key["status"] == "active"
    async with empty_db() as session:
        row = await session.get(Tenant, first.tenant_id)
        assert row is not None and row.status == "active"


async def test_concurrent_suspensions_cannot_both_pass(
    empty_database_url: str, empty_db: async_sessionmaker[AsyncSession]
) -> None:
    """Two admins suspending each other's tenants at once: the second waits for the first, then gets the 409 (on
    PostgreSQL for the rows' lock, on SQLite for the database's write lock)."""
    async with empty_db() as session:
        first = await KeyService(session).bootstrap_admin()
        assert first is not None
        other = await TenantService(session).create(TenantCreate(name="ops"))
        await KeyService(session).create(other.id, KeyCreate(scopes=["admin"]))
    async with empty_db() as winner, empty_db() as loser:
        tenant = await TenantService(winner).get(first.tenant_id)
        await ensure_admin_remains(winner, suspending_tenant=tenant.id)  # passes, and holds the rows
        racing = asyncio.create_task(TenantService(loser).update(other.id, SUSPEND))
        await asyncio.sleep(0.3)
        assert not racing.done()  # blocked on the lock, not deciding on what it read before
        tenant.status = "suspended"
        await winner.commit()
        await _refused(racing)
