"""Authentication (API key → tenant) and scope guards.

Invariants: a missing, malformed, unknown, revoked or expired key is a 401; a suspended tenant is a 403; the
tenant a request acts for comes from its key only — never from the body. `/metrics` is skipped by the
middleware and checks its own bearer: the metrics token (constant time) or an admin key.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac

import msgspec
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.middleware import AbstractAuthenticationMiddleware, AuthenticationResult
from litestar.types import Guard
from sqlalchemy import bindparam, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.db.models import ApiKey, Tenant, as_utc, utcnow
from pagewise.platform.errors import APIError
from pagewise.platform.keys.key_format import parse_key, secret_matches
from pagewise.platform.keys.schemas import key_status
from pagewise.platform.quotas.quota_store import KeyQuota, QuotaLimits

LAST_USED_RESOLUTION = dt.timedelta(
    minutes=1
)  # last_used_at is refreshed at most this often (no write per call)
PUBLIC_PATHS = ("/health", "/ready", "/schema")  # no credentials at all
DASHBOARD_PATH = "/admin/ui"  # the admin dashboard, signed in with an admin key into a session cookie
# routes that check their own credentials: `/metrics` its metrics token (`authorize_metrics`), the dashboard its
# session (`dashboard/access.py`)
SELF_AUTHENTICATED_PATHS = ("/metrics", DASHBOARD_PATH)
UNGUARDED_PATHS = PUBLIC_PATHS + SELF_AUTHENTICATED_PATHS  # what the key middleware skips


class Principal(msgspec.Struct, frozen=True):
    """Who is calling: the key, its scopes and a snapshot of its tenant's limits and scheduling weight, and of
    the key's own limits (`key_quota`, `None` when it has none) and `allowed_models` (`None`: every model)."""

    key_id: str
    tenant_id: str
    tenant_name: str
    scopes: tuple[str, ...]
    limits: QuotaLimits
    max_tokens_per_request: int | None
    max_n: int | None
    weight: float
    key_quota: KeyQuota | None = None
    allowed_models: tuple[str, ...] | None = None


# Built once: every authenticated request runs it, and a reused statement skips rebuilding its clauses.
_KEY_WITH_TENANT = select(ApiKey, Tenant).join(Tenant, Tenant.id == ApiKey.tenant_id).where(
    ApiKey.prefix == bindparam("prefix")
)


def tenant_limits(tenant: Tenant) -> QuotaLimits:
    return QuotaLimits(
        requests_per_minute=tenant.requests_per_minute,
        tokens_per_minute=tenant.tokens_per_minute,
        monthly_token_budget=tenant.monthly_token_budget,
        max_concurrent_requests=tenant.max_concurrent_requests,
        monthly_spend_budget_micros=tenant.monthly_spend_budget_micros,
    )


def key_quota(key: ApiKey) -> KeyQuota | None:
    """The key's own limits as a quota scope, or `None` when it has none (no counters are kept for it)."""
    limits = QuotaLimits(
        requests_per_minute=key.requests_per_minute,
        tokens_per_minute=key.tokens_per_minute,
        monthly_token_budget=key.monthly_token_budget,
        monthly_spend_budget_micros=key.monthly_spend_budget_micros,
    )
    return None if limits == QuotaLimits() else KeyQuota(key.id, limits)


def unauthorized(message: str) -> APIError:
    return APIError(
        401, message, code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="pagewise"'}
    )


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; `None` without one."""
    if not authorization or not authorization.lower().startswith("bearer "):
        return None
    return authorization[7:].strip()


async def authenticate(session: AsyncSession, authorization: str | None) -> Principal:
    """Resolve an `Authorization: Bearer pw_…` header to a principal, or raise 401/403."""
    token = bearer_token(authorization)
    if token is None:
        raise unauthorized("Missing API key: send `Authorization: Bearer pw_<prefix>_<secret>`")
    parsed = parse_key(token)
    if parsed is None:
        raise unauthorized("Malformed API key: expected `pw_<prefix>_<secret>`")
    row = (await session.execute(_KEY_WITH_TENANT, {"prefix": parsed.prefix})).first()
    if row is None or not secret_matches(parsed.secret, row.ApiKey.secret_sha256):
        raise unauthorized("Incorrect API key provided")
    key, tenant = row.ApiKey, row.Tenant
    now = utcnow()
    match key_status(key.revoked_at, key.expires_at, now):
        case "revoked":
            raise unauthorized("This API key has been revoked")
        case "expired":
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
        weight=tenant.weight,
        key_quota=key_quota(key),
        allowed_models=None if key.allowed_models is None else tuple(key.allowed_models),
    )


class ApiKeyAuthMiddleware(AbstractAuthenticationMiddleware):
    """Sets `request.user` to the caller's `Principal` on every non-public route."""

    async def authenticate_request(self, connection: ASGIConnection) -> AuthenticationResult:
        async with connection.app.state.sessionmaker() as session:
            principal = await authenticate(session, connection.headers.get("authorization"))
        return AuthenticationResult(user=principal, auth=principal.key_id)


def check_scope(principal: Principal, scope: str) -> None:
    """403 unless the caller's key carries `scope`."""
    if scope not in principal.scopes:
        raise APIError(403, f"This route needs an API key with the '{scope}' scope", code="insufficient_scope")


def requires_scope(scope: str) -> Guard:
    """A guard: the caller's key must carry `scope` (403 otherwise).

    `OPTIONS` is answered without a key (the authentication middleware skips it, as a CORS preflight needs):
    it only lists the allowed methods, which the public OpenAPI document shows anyway.
    """

    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        if connection.scope["method"] == "OPTIONS":
            return
        check_scope(connection.user, scope)

    return guard


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


async def authorize_metrics(session: AsyncSession, authorization: str | None, metrics_token: str | None) -> None:
    """Let `/metrics` be read with `Authorization: Bearer <metrics_token>` or an admin key.

    No or a wrong bearer is a 401; a valid key without the `admin` scope is a 403 (`insufficient_scope`),
    as on every admin route; a suspended tenant's key is a 403. The token is compared in constant time
    (digests of equal length, so not even its length leaks).
    """
    token = bearer_token(authorization)
    if token is None:
        raise unauthorized("Missing credentials: send `Authorization: Bearer <metrics token or admin API key>`")
    if metrics_token is not None and hmac.compare_digest(_digest(token), _digest(metrics_token)):
        return
    if parse_key(token) is None:
        raise unauthorized("Incorrect metrics token or API key provided")
    check_scope(await authenticate(session, authorization), "admin")
