"""Tenant operations shared by the admin API and the CLI. Names are unique; a clash is a 409.

Every check runs before anything is written, so a refused create or update changes nothing. The checks
repeat what the HTTP decoder enforces (quota bounds from `QUOTA_BOUNDS`, the weight's `MAX_WEIGHT`, the name
rule) because the CLI builds bodies in code.
"""

from __future__ import annotations

import msgspec
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.db.ids import new_id
from pagewise.platform.db.models import Tenant, as_utc
from pagewise.platform.errors import APIError, invalid_request, not_found
from pagewise.platform.tenants.last_admin import ensure_admin_remains
from pagewise.platform.tenants.names import clean_name
from pagewise.platform.tenants.schemas import MAX_WEIGHT, QUOTA_BOUNDS, TenantCreate, TenantOut, TenantUpdate


def tenant_out(tenant: Tenant) -> TenantOut:
    """The body for `tenant`; timestamps in UTC whichever database handed them back."""
    out = TenantOut(**{f: getattr(tenant, f) for f in TenantOut.__struct_fields__})
    out.created_at, out.updated_at = as_utc(out.created_at), as_utc(out.updated_at)
    return out


def _checked(values: dict[str, object]) -> dict[str, object]:
    """`values` with the name cleaned, or a 400 naming the first field out of bounds."""
    name = values.get("name")
    if isinstance(name, str):
        values = {**values, "name": clean_name(name)}
    for field, (minimum, maximum) in QUOTA_BOUNDS.items():
        value = values.get(field)
        if isinstance(value, int) and not minimum <= value <= maximum:
            raise invalid_request(
                f"{field} must be between {minimum:,} and {maximum:,} (or null for no limit); got {value:,}",
                param=field,
            )
    if "weight" in values:
        _check_weight(values["weight"])
    return values


def _check_weight(weight: object) -> None:
    """A 400 naming `weight` unless it is a number in (0, `MAX_WEIGHT`]; NaN and infinity fail the comparison."""
    if not isinstance(weight, int | float) or not 0 < weight <= MAX_WEIGHT:
        raise invalid_request(
            f"weight must be a finite number above 0 and at most {MAX_WEIGHT:g}; got {weight!r}", param="weight"
        )


class TenantService:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def create(self, data: TenantCreate) -> Tenant:
        tenant = self.add(data)
        await self._commit(tenant.name)
        return tenant

    def add(self, data: TenantCreate) -> Tenant:
        """A checked, active tenant added to the session, not yet committed (a caller's transaction)."""
        tenant = Tenant(id=new_id("ten"), status="active", **_checked(msgspec.structs.asdict(data)))
        self.session.add(tenant)
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
        """Apply the fields that are set; suspending the last admin tenant is a 409 `last_admin`."""
        tenant = await self.get(tenant_id)
        values = _checked({k: v for k, v in msgspec.structs.asdict(data).items() if v is not msgspec.UNSET})
        if values.get("status") == "suspended" and tenant.status == "active":
            await ensure_admin_remains(self.session, suspending_tenant=tenant.id)
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
