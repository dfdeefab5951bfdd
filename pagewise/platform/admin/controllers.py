"""`/admin/usage`, `/admin/requests`, `/admin/engine`, `/admin/overview` (admin scope)."""

from __future__ import annotations

import datetime as dt
import time
from typing import Annotated, Any

import msgspec
from litestar import Controller, get
from litestar.params import FromQuery, QueryParameter
from sqlalchemy import func, select

from pagewise.platform.db.models import ApiKey, RequestRecord, Tenant
from pagewise.platform.db.session import DbSession
from pagewise.platform.keys.auth import requires_scope
from pagewise.platform.requests.schemas import RequestList, request_page
from pagewise.platform.services import Services
from pagewise.platform.usage.service import BucketWidth, GroupField, UsagePage, usage_page

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


class AdminController(Controller):
    path = "/admin"
    guards = [requires_scope("admin")]
    tags = ["admin"]

    @get("/usage")
    async def usage(
        self,
        db_session: DbSession,
        start_time: FromQuery[int | None] = None,
        end_time: FromQuery[int | None] = None,
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
        status: FromQuery[str | None] = None,
        since: FromQuery[dt.datetime | None] = None,
        until: FromQuery[dt.datetime | None] = None,
        after: FromQuery[str | None] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=200)] = 50,
    ) -> RequestList:
        query = select(RequestRecord).order_by(RequestRecord.id.desc()).limit(limit + 1)
        filters = [
            RequestRecord.tenant_id == tenant_id if tenant_id else None,
            RequestRecord.status == status if status else None,
            RequestRecord.queued_at >= since if since else None,
            RequestRecord.queued_at < until if until else None,
            RequestRecord.id < after if after else None,
        ]
        query = query.where(*(f for f in filters if f is not None))
        return request_page(list((await db_session.scalars(query)).all()), limit)

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
            select(func.count()).select_from(ApiKey).where(ApiKey.revoked_at.is_(None))
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
