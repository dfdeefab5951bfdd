"""Cross-tenant reads behind the admin views: the JSON routes (`admin/controllers.py`) and the dashboard share them.

Every argument is checked before the database is read: a bad one is a 400 naming it, never a 500 or an empty page.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec
from sqlalchemy import ColumnElement, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.db.models import ApiKey, RequestRecord, Tenant, as_utc, utcnow
from pagewise.platform.errors import invalid_request
from pagewise.platform.requests.store import newest_first
from pagewise.serving.protocol import RequestStatus

TOP_TENANTS = 5
OVERVIEW_WINDOW = dt.timedelta(days=1)


class TenantTokens(msgspec.Struct):
    tenant_id: str
    name: str
    requests: int
    tokens: int


class Overview(msgspec.Struct, kw_only=True):
    """The last 24 hours."""

    tenants: int
    active_keys: int
    requests_by_status: dict[str, int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cost_micros: int
    top_tenants: list[TenantTokens]
    engine: dict[str, Any]


def as_utc_param(moment: dt.datetime | None, param: str) -> dt.datetime | None:
    """`moment` in UTC (naive means UTC already): the stored datetimes compare only with UTC ones."""
    if moment is None:
        return None
    try:
        return as_utc(moment).astimezone(dt.UTC)
    except OverflowError:
        message = f"{param} is out of range: in UTC it falls outside the years 1 to 9999"
        raise invalid_request(message, param=param) from None


async def find_requests(
    session: AsyncSession,
    *,
    tenant_id: str | None = None,
    status: RequestStatus | None = None,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
    after: str | None = None,
    limit: int,
) -> list[RequestRecord]:
    """All tenants' requests, newest first, up to `limit + 1` rows (the extra one says there is more);
    `since`/`until` bound `queued_at` (no offset means UTC) and `until` must be after `since`."""
    since, until = as_utc_param(since, "since"), as_utc_param(until, "until")
    if since is not None and until is not None and until <= since:
        raise invalid_request("until must be after since", param="until")
    filters: list[ColumnElement[bool]] = []
    if tenant_id:
        filters.append(RequestRecord.tenant_id == tenant_id)
    if status is not None:
        filters.append(RequestRecord.status == status.value)
    if since is not None:
        filters.append(RequestRecord.queued_at >= since)
    if until is not None:
        filters.append(RequestRecord.queued_at < until)
    return await newest_first(session, select(RequestRecord), after=after, limit=limit, filters=filters)


async def overview(session: AsyncSession, engine_stats: dict[str, Any]) -> Overview:
    """Counts over requests queued in the last `OVERVIEW_WINDOW`, plus the engine's live `engine_stats`."""
    recent = RequestRecord.queued_at >= dt.datetime.now(dt.UTC) - OVERVIEW_WINDOW
    by_status = dict(
        (
            await session.execute(
                select(RequestRecord.status, func.count()).where(recent).group_by(RequestRecord.status)
            )
        ).all()
    )
    prompt, completion, cached, cost = (
        await session.execute(
            select(
                func.coalesce(func.sum(RequestRecord.prompt_tokens), 0),
                func.coalesce(func.sum(RequestRecord.completion_tokens), 0),
                func.coalesce(func.sum(RequestRecord.cached_tokens), 0),
                func.coalesce(func.sum(RequestRecord.cost_micros), 0),
            ).where(recent)
        )
    ).one()
    tokens = func.sum(RequestRecord.prompt_tokens + RequestRecord.completion_tokens)
    top = (
        await session.execute(
            select(Tenant.id, Tenant.name, func.count(), tokens)
            .join(RequestRecord, RequestRecord.tenant_id == Tenant.id)
            .where(recent)
            .group_by(Tenant.id, Tenant.name)
            .order_by(tokens.desc())
            .limit(TOP_TENANTS)
        )
    ).all()
    active_keys = await session.scalar(
        select(func.count())
        .select_from(ApiKey)
        .where(ApiKey.revoked_at.is_(None), or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > utcnow()))
    )
    return Overview(
        tenants=await session.scalar(select(func.count()).select_from(Tenant)) or 0,
        active_keys=active_keys or 0,
        requests_by_status=by_status,
        prompt_tokens=int(prompt),
        completion_tokens=int(completion),
        cached_tokens=int(cached),
        cost_micros=int(cost),
        top_tenants=[TenantTokens(t, n, int(c), int(k or 0)) for t, n, c, k in top],
        engine=engine_stats,
    )
