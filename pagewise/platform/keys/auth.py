"""Authentication (API key → tenant) and scope guards.

Invariants: a missing, malformed, unknown, revoked or expired key is a 401; a suspended tenant is a 403; the
tenant a request acts for comes from its key only — never from the body. `/metrics` is skipped by the
middleware and checks its own bearer: the metrics token (constant time) or an admin key.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
from functools import partial

import msgspec
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.middleware import AbstractAuthenticationMiddleware, AuthenticationResult
from litestar.types import Guard
from sqlalchemy import Connection, Row, bindparam, select, update

from pagewise.engine.limits import PRIORITY_CLASSES
from pagewise.platform.db.database import Database
from pagewise.platform.db.models import ApiKey, Tenant, as_utc, utcnow
from pagewise.platform.errors import APIError
from pagewise.platform.keys.auth_throttle import FailedAuthThrottle
from pagewise.platform.keys.key_format import ParsedKey, parse_key, secret_matches
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
    the key's own limits (`key_quota`, `None` when it has none), `allowed_models` (`None`: every model) and the
    best priority its requests may run at (`priority_floor`, from the key's `priority_class`)."""

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
    priority_floor: int = 0


_KEYS, _TENANTS = ApiKey.__table__, Tenant.__table__
_TENANT_COLUMNS = ("name", "status", *QuotaLimits.__struct_fields__, "max_tokens_per_request", "max_n", "weight")
# Built once (every authenticated request runs it): the key's columns, and its tenant's as `tenant_<column>`.
_KEYS_WITH_TENANTS = select(_KEYS, *(_TENANTS.c[name].label(f"tenant_{name}") for name in _TENANT_COLUMNS)).join(
    _TENANTS, _TENANTS.c.id == _KEYS.c.tenant_id
)
_KEY_WITH_TENANT = _KEYS_WITH_TENANTS.where(_KEYS.c.prefix == bindparam("prefix"))
_KEY_BY_ID = _KEYS_WITH_TENANTS.where(_KEYS.c.id == bindparam("key_id"))
_TOUCH = update(_KEYS).where(_KEYS.c.id == bindparam("key_id"))


KEY_QUOTA_FIELDS = tuple(name for name in QuotaLimits.__struct_fields__ if name != "max_concurrent_requests")


def tenant_limits(row: Row) -> QuotaLimits:
    """The quota limits of the tenant in a `_KEY_WITH_TENANT` row (its columns carry the limits' names)."""
    return QuotaLimits(**{name: getattr(row, f"tenant_{name}") for name in QuotaLimits.__struct_fields__})


def key_quota(row: Row) -> KeyQuota | None:
    """The key's own limits as a quota scope, or `None` when it has none (no counters are kept for it). The
    scope is the key's budget lineage (its first rotation's id), so a rotated key continues its budget. A key
    has every limit a tenant has but concurrency, which stays the tenant's."""
    limits = QuotaLimits(**{name: getattr(row, name) for name in KEY_QUOTA_FIELDS})
    return None if limits == QuotaLimits() else KeyQuota(row.budget_key_id or row.id, limits)


def unauthorized(message: str) -> APIError:
    return APIError(
        401, message, code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="pagewise"'}
    )


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; `None` without one."""
    if not authorization or not authorization.lower().startswith("bearer "):
        return None
    return authorization[7:].strip()


async def authenticate(
    database: Database,
    authorization: str | None,
    throttle: FailedAuthThrottle | None = None,
    address: str = "",
) -> Principal:
    """Resolve an `Authorization: Bearer pw_…` header from client `address` to a principal, or raise 401/403 —
    or 429 when `throttle` has seen too many failed lookups from that address or for that key's prefix. Every
    route passes its app's throttle; only the tests and the admin command line, which face no network, omit it."""
    token = bearer_token(authorization)
    if token is None:
        raise unauthorized("Missing API key: send `Authorization: Bearer pw_<prefix>_<secret>`")
    parsed = parse_key(token)
    if parsed is None:
        raise unauthorized("Malformed API key: expected `pw_<prefix>_<secret>`")
    if throttle is not None:
        throttle.check(address, parsed.prefix)
    try:
        return await database.run(partial(_principal, parsed))
    except APIError as error:
        if error.status_code == 401 and throttle is not None:
            throttle.failed(address, parsed.prefix)
        raise


def client_address(connection: ASGIConnection) -> str:
    """The peer's address as the server saw it (behind a proxy: the proxy's)."""
    return connection.client.host if connection.client is not None else ""


def _principal(parsed: ParsedKey, connection: Connection) -> Principal:
    """`authenticate`'s unit of work: look the key up, check it, refresh its `last_used_at` when stale."""
    row = connection.execute(_KEY_WITH_TENANT, {"prefix": parsed.prefix}).first()
    if row is None or not secret_matches(parsed.secret, row.secret_sha256):
        raise unauthorized("Incorrect API key provided")
    now = utcnow()
    principal = _checked(row, now)
    if row.last_used_at is None or now - as_utc(row.last_used_at) > LAST_USED_RESOLUTION:
        connection.execute(_TOUCH, {"key_id": row.id, "last_used_at": now})
    return principal


def principal_of_key(key_id: str, connection: Connection) -> Principal:
    """The principal a key stands for now, by its id (work it started earlier, a batch's requests, runs as the key
    and its tenant are at that moment): a deleted, revoked or expired key is a 401, a suspended tenant a 403."""
    row = connection.execute(_KEY_BY_ID, {"key_id": key_id}).first()
    if row is None:
        raise unauthorized("The API key that made this request no longer exists")
    return _checked(row, utcnow())


def _checked(row: Row, now: dt.datetime) -> Principal:
    """The principal of a key-with-tenant row, once the key is working and its tenant active."""
    match key_status(row.revoked_at, row.expires_at, now):
        case "revoked":
            raise unauthorized("This API key has been revoked")
        case "expired":
            raise unauthorized("This API key has expired")
    if row.tenant_status != "active":
        raise APIError(403, f"Tenant '{row.tenant_name}' is {row.tenant_status}", code="tenant_suspended")
    return Principal(
        key_id=row.id,
        tenant_id=row.tenant_id,
        tenant_name=row.tenant_name,
        scopes=tuple(row.scopes),
        limits=tenant_limits(row),
        max_tokens_per_request=row.tenant_max_tokens_per_request,
        max_n=row.tenant_max_n,
        weight=row.tenant_weight,
        key_quota=key_quota(row),
        allowed_models=None if row.allowed_models is None else tuple(row.allowed_models),
        priority_floor=PRIORITY_CLASSES[row.priority_class or "interactive"],
    )


class ApiKeyAuthMiddleware(AbstractAuthenticationMiddleware):
    """Sets `request.user` to the caller's `Principal` on every non-public route."""

    async def authenticate_request(self, connection: ASGIConnection) -> AuthenticationResult:
        services = connection.app.state.services
        authorization = connection.headers.get("authorization")
        principal = await authenticate(
            services.database, authorization, services.auth_failures, client_address(connection)
        )
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


async def authorize_metrics(
    database: Database,
    authorization: str | None,
    metrics_token: str | None,
    throttle: FailedAuthThrottle | None = None,
    address: str = "",
) -> None:
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
    check_scope(await authenticate(database, authorization, throttle, address), "admin")
