"""Tenant operations shared by the admin API and the CLI. Names are unique; a clash is a 409."""

from __future__ import annotations

import msgspec
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.db.ids import new_id
from pagewise.platform.db.models import Tenant
from pagewise.platform.errors import APIError, invalid_request, not_found
from pagewise.platform.tenants.schemas import TenantCreate, TenantOut, TenantUpdate

_QUOTA_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "monthly_token_budget",
    "max_concurrent_requests",
    "max_tokens_per_request",
    "max_n",
)
_MINIMUM = {"max_n": 1, "max_concurrent_requests": 1, "max_tokens_per_request": 1}


def tenant_out(tenant: Tenant) -> TenantOut:
    return TenantOut(**{f: getattr(tenant, f) for f in TenantOut.__struct_fields__})


def _check_values(values: dict[str, object]) -> None:
    name = values.get("name")
    if name is not None and not str(name).strip():
        raise invalid_request("name must not be empty", param="name")
    for field in _QUOTA_FIELDS:
        value, minimum = values.get(field), _MINIMUM.get(field, 0)
        if isinstance(value, int) and value < minimum:
            raise invalid_request(
                f"{field} must be at least {minimum} (or null for no limit); got {value}", param=field
            )


class TenantService:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def create(self, data: TenantCreate) -> Tenant:
        values = msgspec.structs.asdict(data)
        _check_values(values)
        tenant = Tenant(id=new_id("ten"), status="active", **values)
        self.session.add(tenant)
        await self._commit(tenant.name)
        return tenant

    async def list(self) -> list[Tenant]:
        return list((await self.session.scalars(select(Tenant).order_by(Tenant.id))).all())

    async def get(self, tenant_id: str) -> Tenant:
        tenant = await self.session.get(Tenant, tenant_id)
        if tenant is None:
            raise not_found("tenant", tenant_id)
        return tenant

    async def get_by_name(self, name: str) -> Tenant:
        tenant = await self.session.scalar(select(Tenant).where(Tenant.name == name))
        if tenant is None:
            raise APIError(404, f"No tenant named '{name}'", code="not_found", param="name")
        return tenant

    async def update(self, tenant_id: str, data: TenantUpdate) -> Tenant:
        tenant = await self.get(tenant_id)
        values = {k: v for k, v in msgspec.structs.asdict(data).items() if v is not msgspec.UNSET}
        _check_values(values)
        for key, value in values.items():
            setattr(tenant, key, value)
        await self._commit(tenant.name)
        return tenant

    async def _commit(self, name: str) -> None:
        try:
            await self.session.commit()
        except IntegrityError:
            await self.session.rollback()
            raise APIError(
                409, f"A tenant named '{name}' already exists", code="tenant_exists", param="name"
            ) from None
