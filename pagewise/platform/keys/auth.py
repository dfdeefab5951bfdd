"""Authentication (API key → tenant) and scope guards.

Invariants: a missing, malformed, unknown, revoked or expired key is a 401; a suspended tenant is a 403; the
tenant a request acts for comes from its key only — never from the body.
"""

from __future__ import annotations

import datetime as dt

import msgspec
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.middleware import AbstractAuthenticationMiddleware, AuthenticationResult
from litestar.types import Guard
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.db.models import ApiKey, Tenant, as_utc, utcnow
from pagewise.platform.errors import APIError
from pagewise.platform.keys.key_format import parse_key, secret_matches
from pagewise.platform.quotas.quota_store import QuotaLimits

LAST_USED_RESOLUTION = dt.timedelta(
    minutes=1
)  # last_used_at is refreshed at most this often (no write per call)
PUBLIC_PATHS = ("/health", "/ready", "/metrics", "/schema")  # no key needed


class Principal(msgspec.Struct, frozen=True):
    """Who is calling: the key, its scopes and a snapshot of its tenant's limits."""

    key_id: str
    tenant_id: str
    tenant_name: str
    scopes: tuple[str, ...]
    limits: QuotaLimits
    max_tokens_per_request: int | None
    max_n: int | None


def tenant_limits(tenant: Tenant) -> QuotaLimits:
    return QuotaLimits(
        requests_per_minute=tenant.requests_per_minute,
        tokens_per_minute=tenant.tokens_per_minute,
        monthly_token_budget=tenant.monthly_token_budget,
        max_concurrent_requests=tenant.max_concurrent_requests,
    )


def unauthorized(message: str) -> APIError:
    return APIError(
        401, message, code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="pagewise"'}
    )


async def authenticate(session: AsyncSession, authorization: str | None) -> Principal:
    """Resolve an `Authorization: Bearer pw_…` header to a principal, or raise 401/403."""
    if not authorization or not authorization.lower().startswith("bearer "):
        raise unauthorized("Missing API key: send `Authorization: Bearer pw_<prefix>_<secret>`")
    parsed = parse_key(authorization[7:].strip())
    if parsed is None:
        raise unauthorized("Malformed API key: expected `pw_<prefix>_<secret>`")
    row = (
        await session.execute(
            select(ApiKey, Tenant)
            .join(Tenant, Tenant.id == ApiKey.tenant_id)
            .where(ApiKey.prefix == parsed.prefix)
        )
    ).first()
    if row is None or not secret_matches(parsed.secret, row.ApiKey.secret_sha256):
        raise unauthorized("Incorrect API key provided")
    key, tenant = row.ApiKey, row.Tenant
    now = utcnow()
    if key.revoked_at is not None:
        raise unauthorized("This API key has been revoked")
    if key.expires_at is not None and as_utc(key.expires_at) <= now:
        raise unauthorized("This API key has expired")
    if tenant.status != "active":
        raise APIError(403, f"Tenant '{tenant.name}' is {tenant.status}", code="tenant_suspended")
    if key.last_used_at is None or now - as_utc(key.last_used_at) > LAST_USED_RESOLUTION:
        await session.execute(update(ApiKey).where(ApiKey.id == key.id).values(last_used_at=now))
        await session.commit()
    return Principal(
        key_id=key.id,
        tenant_id=tenant.id,
        tenant_name=tenant.name,
        scopes=tuple(key.scopes),
        limits=tenant_limits(tenant),
        max_tokens_per_request=tenant.max_tokens_per_request,
        max_n=tenant.max_n,
    )


class ApiKeyAuthMiddleware(AbstractAuthenticationMiddleware):
    """Sets `request.user` to the caller's `Principal` on every non-public route."""

    async def authenticate_request(self, connection: ASGIConnection) -> AuthenticationResult:
        async with connection.app.state.sessionmaker() as session:
            principal = await authenticate(session, connection.headers.get("authorization"))
        return AuthenticationResult(user=principal, auth=principal.key_id)


def requires_scope(scope: str) -> Guard:
    """A guard: the caller's key must carry `scope` (403 otherwise)."""

    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        principal: Principal = connection.user
        if scope not in principal.scopes:
            raise APIError(
                403, f"This route needs an API key with the '{scope}' scope", code="insufficient_scope"
            )

    return guard
