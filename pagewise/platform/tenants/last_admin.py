"""The rule that keeps the platform administrable: some active tenant always holds an active admin key.

An admin key is active when it carries the `admin` scope, is not revoked and has not expired; it works only
while its tenant is active (a suspended tenant's keys are refused). Suspending a tenant and revoking a key
both go through `ensure_admin_remains`, which refuses (409 `last_admin`, nothing changed) the change that
would take that number from one or more to zero. A change that leaves it where it is is never refused, so a
database that has already lost every admin (all keys expired) can still be managed from the CLI.

The check holds what it read until the caller commits, so two concurrent changes cannot both pass it and
together lock everyone out: on PostgreSQL it locks the rows it reads (`FOR UPDATE`), on SQLite it takes the
database's write lock before reading (`sqlite_write_lock`).
"""

from __future__ import annotations

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.db.models import ApiKey, Tenant, utcnow
from pagewise.platform.db.session import sqlite_write_lock
from pagewise.platform.errors import APIError

ADMIN_SCOPE = "admin"


async def working_admin_keys(session: AsyncSession) -> list[tuple[str, str]]:
    """(key id, tenant id) of every active admin key of an active tenant; their rows (on SQLite, the whole
    database's writes) stay locked until the session commits."""
    if (lock := sqlite_write_lock(session)) is not None:
        await session.execute(lock)
    rows = await session.execute(
        select(ApiKey.id, ApiKey.tenant_id, ApiKey.scopes)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(
            Tenant.status == "active",
            ApiKey.revoked_at.is_(None),
            or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > utcnow()),
        )
        .with_for_update()
    )
    return [(key_id, tenant_id) for key_id, tenant_id, scopes in rows if ADMIN_SCOPE in scopes]


async def ensure_admin_remains(
    session: AsyncSession, *, suspending_tenant: str | None = None, revoking_key: str | None = None
) -> None:
    """Raise 409 `last_admin` if suspending `suspending_tenant` or revoking `revoking_key` (one of them)
    would leave no working admin key where there is one now."""
    working = await working_admin_keys(session)
    remaining = [(k, t) for k, t in working if t != suspending_tenant and k != revoking_key]
    if working and not remaining:
        action = "suspending this tenant" if suspending_tenant else "revoking this key"
        raise APIError(
            409,
            f"Refusing: {action} would leave no active tenant with an active admin key, locking every "
            "administrator out; create another admin key (or tenant) first",
            code="last_admin",
        )
