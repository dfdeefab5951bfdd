"""`/admin/tenants` (admin scope): create, list, get, update quotas and status, suspend."""

from __future__ import annotations

from litestar import Controller, get, patch, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, SkipValidation

from pagewise.platform.bodies import StrictBody, parse_body
from pagewise.platform.db.session import DbSession
from pagewise.platform.keys.auth import requires_scope
from pagewise.platform.tenants.schemas import TenantCreate, TenantOut, TenantUpdate
from pagewise.platform.tenants.service import TenantService, tenant_out

Tenants = NamedDependency[SkipValidation[TenantService]]


def provide_tenant_service(db_session: DbSession) -> TenantService:
    return TenantService(db_session)


class TenantController(Controller):
    path = "/admin/tenants"
    guards = [requires_scope("admin")]
    dependencies = {"tenants": Provide(provide_tenant_service, sync_to_thread=False)}
    tags = ["admin"]

    @post("/")
    async def create_tenant(self, data: StrictBody[TenantCreate], tenants: Tenants) -> TenantOut:
        return tenant_out(await tenants.create(parse_body(data, TenantCreate)))

    @get("/")
    async def list_tenants(self, tenants: Tenants) -> list[TenantOut]:
        return [tenant_out(t) for t in await tenants.list()]

    @get("/{tenant_id:str}")
    async def get_tenant(self, tenant_id: FromPath[str], tenants: Tenants) -> TenantOut:
        return tenant_out(await tenants.get(tenant_id))

    @patch("/{tenant_id:str}")
    async def update_tenant(
        self, tenant_id: FromPath[str], data: StrictBody[TenantUpdate], tenants: Tenants
    ) -> TenantOut:
        return tenant_out(await tenants.update(tenant_id, parse_body(data, TenantUpdate)))

    @post("/{tenant_id:str}/suspend", status_code=200)
    async def suspend_tenant(self, tenant_id: FromPath[str], tenants: Tenants) -> TenantOut:
        return tenant_out(await tenants.update(tenant_id, TenantUpdate(status="suspended")))
