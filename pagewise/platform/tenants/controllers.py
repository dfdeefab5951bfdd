"""`/admin/tenants` (admin scope): create, list, get, update quotas and status, suspend."""

from __future__ import annotations

from litestar import Controller, get, patch, post
from litestar.di import Provide
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.keys.auth import requires_scope
from pagewise.platform.tenants.schemas import TenantCreate, TenantOut, TenantUpdate
from pagewise.platform.tenants.service import TenantService, tenant_out


def provide_tenant_service(db_session: AsyncSession) -> TenantService:
    return TenantService(db_session)


class TenantController(Controller):
    path = "/admin/tenants"
    guards = [requires_scope("admin")]
    dependencies = {"tenants": Provide(provide_tenant_service, sync_to_thread=False)}
    tags = ["admin"]

    @post("/")
    async def create_tenant(self, data: TenantCreate, tenants: TenantService) -> TenantOut:
        return tenant_out(await tenants.create(data))

    @get("/")
    async def list_tenants(self, tenants: TenantService) -> list[TenantOut]:
        return [tenant_out(t) for t in await tenants.list()]

    @get("/{tenant_id:str}")
    async def get_tenant(self, tenant_id: str, tenants: TenantService) -> TenantOut:
        return tenant_out(await tenants.get(tenant_id))

    @patch("/{tenant_id:str}")
    async def update_tenant(self, tenant_id: str, data: TenantUpdate, tenants: TenantService) -> TenantOut:
        return tenant_out(await tenants.update(tenant_id, data))

    @post("/{tenant_id:str}/suspend", status_code=200)
    async def suspend_tenant(self, tenant_id: str, tenants: TenantService) -> TenantOut:
        return tenant_out(await tenants.update(tenant_id, TenantUpdate(status="suspended")))
