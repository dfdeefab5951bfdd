"""API-key operations shared by the admin API, the CLI and the first-start bootstrap."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.db.ids import new_id
from pagewise.platform.db.models import ApiKey, Tenant, as_utc, utcnow
from pagewise.platform.errors import invalid_request, not_found
from pagewise.platform.keys.key_format import generate_key
from pagewise.platform.keys.schemas import KeyCreate, KeyCreated, KeyOut
from pagewise.platform.tenants.schemas import TenantCreate
from pagewise.platform.tenants.service import TenantService

BOOTSTRAP_TENANT = "admin"


def key_out(key: ApiKey) -> KeyOut:
    return KeyOut(**{f: getattr(key, f) for f in KeyOut.__struct_fields__})


def key_created(key: ApiKey, secret_key: str) -> KeyCreated:
    return KeyCreated(key=secret_key, **{f: getattr(key, f) for f in KeyOut.__struct_fields__})


class KeyService:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def create(self, tenant_id: str, data: KeyCreate) -> KeyCreated:
        """Create a key; the returned `key` is the only copy that will ever exist."""
        await TenantService(self.session).get(tenant_id)
        if not data.scopes:
            raise invalid_request("scopes must name at least one of: inference, admin", param="scopes")
        if data.expires_at is not None and as_utc(data.expires_at) <= utcnow():
            raise invalid_request("expires_at must be in the future", param="expires_at")
        new = generate_key()
        key = ApiKey(
            id=new_id("key"),
            tenant_id=tenant_id,
            name=data.name,
            prefix=new.prefix,
            secret_sha256=new.secret_sha256,
            scopes=sorted(set(data.scopes)),
            expires_at=data.expires_at,
        )
        self.session.add(key)
        await self.session.commit()
        return key_created(key, new.key)

    async def list(self, tenant_id: str | None = None) -> list[ApiKey]:
        query = select(ApiKey).order_by(ApiKey.id)
        if tenant_id is not None:
            await TenantService(self.session).get(tenant_id)
            query = query.where(ApiKey.tenant_id == tenant_id)
        return list((await self.session.scalars(query)).all())

    async def get(self, tenant_id: str, key_id: str) -> ApiKey:
        key = await self.session.get(ApiKey, key_id)
        if key is None or key.tenant_id != tenant_id:
            raise not_found("API key", key_id)
        return key

    async def revoke(self, tenant_id: str, key_id: str) -> ApiKey:
        key = await self.get(tenant_id, key_id)
        if key.revoked_at is None:
            key.revoked_at = utcnow()
            await self.session.commit()
        return key

    async def rotate(self, tenant_id: str, key_id: str) -> KeyCreated:
        """Revoke a key and issue a new one with the same name, scopes and expiry."""
        old = await self.revoke(tenant_id, key_id)
        expires_at = old.expires_at if old.expires_at and as_utc(old.expires_at) > utcnow() else None
        return await self.create(
            tenant_id, KeyCreate(name=old.name, scopes=list(old.scopes), expires_at=expires_at)
        )

    async def bootstrap_admin(self) -> KeyCreated | None:
        """On an empty database only: an `admin` tenant and a key with both scopes. Later calls do nothing."""
        if await self.session.scalar(select(func.count()).select_from(Tenant)):
            return None
        tenant = await TenantService(self.session).create(TenantCreate(name=BOOTSTRAP_TENANT))
        return await self.create(tenant.id, KeyCreate(name="bootstrap admin", scopes=["admin", "inference"]))
