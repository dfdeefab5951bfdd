"""API-key operations shared by the admin API, the CLI and the first-start bootstrap.

Invariants: every check runs before anything is written (a refused call changes nothing); a rotation
writes the new key and retires the old one in one commit, and the new key keeps the old one's limits (its
counters start afresh under its own id); revoking the last working admin key is refused
(`tenants.last_admin`); the bootstrap creates the admin tenant and its key in one commit.
"""

from __future__ import annotations

import datetime as dt

import msgspec
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.db.ids import new_id
from pagewise.platform.db.models import ApiKey, Tenant, as_utc, utcnow
from pagewise.platform.errors import APIError, invalid_request, not_found
from pagewise.platform.keys.key_format import NewKey, generate_key, key_from_string
from pagewise.platform.keys.schemas import (
    KEY_LIMIT_FIELDS,
    MAX_GRACE_PERIOD_S,
    KeyCreate,
    KeyCreated,
    KeyOut,
    KeyUpdate,
    key_status,
)
from pagewise.platform.tenants.last_admin import ADMIN_SCOPE, ensure_admin_remains
from pagewise.platform.tenants.names import clean_name
from pagewise.platform.tenants.schemas import TenantCreate
from pagewise.platform.tenants.service import TenantService

BOOTSTRAP_TENANT = "admin"
_STORED_FIELDS = tuple(f for f in KeyOut.__struct_fields__ if f != "status")


def key_out(key: ApiKey) -> KeyOut:
    return KeyOut(status=key_status(key.revoked_at, key.expires_at, utcnow()), **_stored(key))


def key_created(key: ApiKey, secret_key: str) -> KeyCreated:
    return KeyCreated(key=secret_key, **msgspec.structs.asdict(key_out(key)))


def _stored(key: ApiKey) -> dict[str, object]:
    """The stored fields of a body; timestamps in UTC whichever database handed them back."""
    values = {f: getattr(key, f) for f in _STORED_FIELDS}
    return {f: as_utc(v) if isinstance(v, dt.datetime) else v for f, v in values.items()}


def _checked_limits(values: dict[str, object]) -> dict[str, object]:
    """`values` with `allowed_models` cleaned (each a model name, stripped; duplicates dropped, sorted)."""
    models = values.get("allowed_models")
    if isinstance(models, list):
        values = {**values, "allowed_models": sorted({clean_name(m, param="allowed_models") for m in models})}
    return values


def _limits_of(data: KeyCreate) -> dict[str, object]:
    return _checked_limits({f: getattr(data, f) for f in KEY_LIMIT_FIELDS})


def _checked_expiry(expires_at: dt.datetime | None) -> dt.datetime | None:
    """`expires_at` in UTC (naive means UTC), or a 400 unless it is in the future and within year 9999."""
    if expires_at is None:
        return None
    try:
        utc = as_utc(expires_at).astimezone(dt.UTC)
    except OverflowError:
        raise invalid_request("expires_at must be at most 9999-12-31T23:59:59Z", param="expires_at") from None
    if utc <= utcnow():
        raise invalid_request(f"expires_at must be in the future; got {utc.isoformat()}", param="expires_at")
    return utc


class KeyService:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def create(self, tenant_id: str, data: KeyCreate) -> KeyCreated:
        """Create a key; the returned `key` is the only copy that will ever exist."""
        await TenantService(self.session).get(tenant_id)
        if not data.scopes:
            raise invalid_request("scopes must name at least one of: inference, admin", param="scopes")
        name = clean_name(data.name, allow_empty=True)
        expires_at = _checked_expiry(data.expires_at)
        limits = _limits_of(data)
        new = generate_key()
        key = self._add(tenant_id, name, data.scopes, expires_at, new, limits)
        await self.session.commit()
        return key_created(key, new.key)

    async def update(self, tenant_id: str, key_id: str, data: KeyUpdate) -> ApiKey:
        """Change the key's limits that are set in `data`; a revoked key's too (they no longer matter)."""
        key = await self.get(tenant_id, key_id)
        changes = _checked_limits({k: v for k, v in msgspec.structs.asdict(data).items() if v is not msgspec.UNSET})
        for field, value in changes.items():
            setattr(key, field, value)
        await self.session.commit()
        return key

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
        """Revoke a key (again: a no-op); the last working admin key is a 409 `last_admin`."""
        key = await self.get(tenant_id, key_id)
        if key.revoked_at is None:
            if ADMIN_SCOPE in key.scopes:
                await ensure_admin_remains(self.session, revoking_key=key.id)
            key.revoked_at = utcnow()
            await self.session.commit()
        return key

    async def rotate(self, tenant_id: str, key_id: str, grace_period_s: int = 0) -> KeyCreated:
        """Issue a new key with the old one's name, scopes, limits and expiry; retire the old one. The new key
        continues the old one's budget: both count under the first key of the lineage (`budget_key_id`).

        With `grace_period_s` 0 the old key is revoked at once; otherwise it keeps working until the earlier
        of its own expiry and now + grace. A revoked or expired key is a 409 (`key_revoked`, `key_expired`).
        """
        old = await self.get(tenant_id, key_id)
        now = utcnow()
        status = key_status(old.revoked_at, old.expires_at, now)
        if status != "active":
            raise APIError(
                409,
                f"API key '{key_id}' is {status} and cannot be rotated; create a new key instead",
                code=f"key_{status}",
                param="key_id",
            )
        if not 0 <= grace_period_s <= MAX_GRACE_PERIOD_S:
            raise invalid_request(
                f"grace_period_s must be between 0 and {MAX_GRACE_PERIOD_S:,}; got {grace_period_s:,}",
                param="grace_period_s",
            )
        new = generate_key()
        limits = {f: getattr(old, f) for f in KEY_LIMIT_FIELDS}
        key = self._add(tenant_id, old.name, old.scopes, old.expires_at, new, limits, old.budget_key_id or old.id)
        if grace_period_s == 0:
            old.revoked_at = now
        else:
            cutoff = now + dt.timedelta(seconds=grace_period_s)
            old.expires_at = min(as_utc(old.expires_at), cutoff) if old.expires_at else cutoff
        await self.session.commit()
        return key_created(key, new.key)

    async def bootstrap_admin(self, key: str | None = None) -> KeyCreated | None:
        """On an empty database only: an `admin` tenant and a key with both scopes, in one commit.

        `key` (from `PAGEWISE_ADMIN_KEY`) is stored as that key instead of a generated one; a malformed
        one is a `ValueError`, even when nothing would be created. On a database that has any tenant this
        does nothing and returns `None` — also when `key` is given and no key has its prefix: the variable
        seeds an empty database, it never adds or replaces keys later.
        """
        new = key_from_string(key) if key is not None else generate_key()
        if await self.session.scalar(select(func.count()).select_from(Tenant)):
            return None
        tenant = TenantService(self.session).add(TenantCreate(name=BOOTSTRAP_TENANT))
        await self.session.flush()  # the tenant row first: no relationship tells the ORM the order
        created = self._add(tenant.id, "bootstrap admin", ["admin", "inference"], None, new)
        await self.session.commit()
        return key_created(created, new.key)

    def _add(
        self,
        tenant_id: str,
        name: str,
        scopes: list[str],
        expires_at: dt.datetime | None,
        new: NewKey,
        limits: dict[str, object] | None = None,
        budget_key_id: str | None = None,
    ) -> ApiKey:
        """A key row added to the session, not yet committed; only the prefix and the hash are stored.
        `budget_key_id` is the first key of the rotations this one continues (its budget is theirs)."""
        key = ApiKey(
            id=new_id("key"),
            tenant_id=tenant_id,
            name=name,
            prefix=new.prefix,
            secret_sha256=new.secret_sha256,
            scopes=sorted(set(scopes)),
            expires_at=expires_at,
            budget_key_id=budget_key_id,
            **(limits or {}),
        )
        self.session.add(key)
        return key
