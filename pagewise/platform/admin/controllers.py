"""`/admin/usage`, `/admin/requests`, `/admin/engine`, `/admin/overview` (admin scope).

Query parameters are validated before any read: a bad one is a 400 naming it, never a 500 or an empty page.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Annotated, Any

import msgspec
from litestar import Controller, get
from litestar.params import FromPath, FromQuery, QueryParameter
from sqlalchemy import ColumnElement, func, or_, select

from pagewise.platform.db.models import ApiKey, RequestRecord, RequestStatus, Tenant, as_utc, utcnow
from pagewise.platform.db.session import DbSession
from pagewise.platform.errors import invalid_request, not_found
from pagewise.platform.keys.auth import requires_scope
from pagewise.platform.requests.schemas import RequestList, RequestOut, request_out, request_page
from pagewise.platform.requests.store import newest_first
from pagewise.platform.services import Services
from pagewise.platform.usage.service import BucketWidth, GroupField, UnixTime, UsagePage, usage_page

DEFAULT_RANGE_S = 7 * 86400
TOP_TENANTS = 5


class EngineView(msgspec.Struct):
    model: str
    max_model_len: int
    stats: dict[str, Any]


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
    top_tenants: list[TenantTokens]
    engine: dict[str, Any]


def _utc(moment: dt.datetime | None, param: str) -> dt.datetime | None:
    """`moment` in UTC (naive means UTC already): the stored datetimes compare only with UTC ones."""
    if moment is None:
        return None
    try:
        return as_utc(moment).astimezone(dt.UTC)
    except OverflowError:
        message = f"{param} is out of range: in UTC it falls outside the years 1 to 9999"
        raise invalid_request(message, param=param) from None


class AdminController(Controller):
    path = "/admin"
    guards = [requires_scope("admin")]
    tags = ["admin"]

    @get("/usage")
    async def usage(
        self,
        db_session: DbSession,
        start_time: UnixTime = None,
        end_time: UnixTime = None,
        bucket_width: FromQuery[BucketWidth] = "1d",
        group_by: FromQuery[list[GroupField] | None] = None,
        tenant_id: FromQuery[str | None] = None,
    ) -> UsagePage:
        start = start_time if start_time is not None else int(time.time()) - DEFAULT_RANGE_S
        return await usage_page(
            db_session,
            start_time=start,
            end_time=end_time,
            width=bucket_width,
            group_by=group_by or [],
            tenant_id=tenant_id,
        )

    @get("/requests")
    async def requests(
        self,
        db_session: DbSession,
        tenant_id: FromQuery[str | None] = None,
        status: FromQuery[RequestStatus | None] = None,
        since: FromQuery[dt.datetime | None] = None,
        until: FromQuery[dt.datetime | None] = None,
        after: FromQuery[str | None] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=200)] = 50,
    ) -> RequestList:
        """All tenants' requests, newest first; `since`/`until` bound `queued_at` (no offset means UTC)."""
        since, until = _utc(since, "since"), _utc(until, "until")
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
        rows = await newest_first(db_session, select(RequestRecord), after=after, limit=limit, filters=filters)
        return request_page(rows, limit)

    @get("/requests/{request_id:str}")
    async def get_request(self, request_id: FromPath[str], db_session: DbSession) -> RequestOut:
        row = await db_session.get(RequestRecord, request_id)
        if row is None:
            raise not_found("request", request_id)
        return request_out(row)

    @get("/engine")
    async def engine(self, services: Services) -> EngineView:
        e = services.engine
        return EngineView(e.model_name, e.max_model_len, e.stats())

    @get("/overview")
    async def overview(self, db_session: DbSession, services: Services) -> Overview:
        since = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
        recent = RequestRecord.queued_at >= since
        by_status = dict(
            (
                await db_session.execute(
                    select(RequestRecord.status, func.count()).where(recent).group_by(RequestRecord.status)
                )
            ).all()
        )
        prompt, completion, cached = (
            await db_session.execute(
                select(
                    func.coalesce(func.sum(RequestRecord.prompt_tokens), 0),
                    func.coalesce(func.sum(RequestRecord.completion_tokens), 0),
                    func.coalesce(func.sum(RequestRecord.cached_tokens), 0),
                ).where(recent)
            )
        ).one()
        tokens = func.sum(RequestRecord.prompt_tokens + RequestRecord.completion_tokens)
        top = (
            await db_session.execute(
                select(Tenant.id, Tenant.name, func.count(), tokens)
                .join(RequestRecord, RequestRecord.tenant_id == Tenant.id)
                .where(recent)
                .group_by(Tenant.id, Tenant.name)
                .order_by(tokens.desc())
                .limit(TOP_TENANTS)
            )
        ).all()
        active_keys = await db_session.scalar(
            select(func.count())
            .select_from(ApiKey)
            .where(ApiKey.revoked_at.is_(None), or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > utcnow()))
        )
        return Overview(
            tenants=await db_session.scalar(select(func.count()).select_from(Tenant)) or 0,
            active_keys=active_keys or 0,
            requests_by_status=by_status,
            prompt_tokens=int(prompt),
            completion_tokens=int(completion),
            cached_tokens=int(cached),
            top_tenants=[TenantTokens(t, n, int(c), int(k or 0)) for t, n, c, k in top],
            engine=services.engine.stats(),
        )
