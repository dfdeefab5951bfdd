"""`/admin/usage`, `/admin/requests`, `/admin/engine`, `/admin/overview` (admin scope).

Query parameters are validated before any read: a bad one is a 400 naming it, never a 500 or an empty page.
The reads themselves live in `admin/queries.py`, which the dashboard shares.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Annotated, Any

import msgspec
from litestar import Controller, get
from litestar.params import FromPath, FromQuery, QueryParameter

from pagewise.platform.admin import queries
from pagewise.platform.admin.queries import Overview
from pagewise.platform.db.models import RequestRecord
from pagewise.platform.db.session import DbSession
from pagewise.platform.errors import not_found
from pagewise.platform.keys.auth import requires_scope
from pagewise.platform.requests.schemas import RequestList, RequestOut, request_out, request_page
from pagewise.platform.services import Services
from pagewise.platform.usage.service import BucketWidth, GroupField, UnixTime, UsagePage, usage_page
from pagewise.serving.protocol import RequestStatus

DEFAULT_RANGE_S = 7 * 86400


class EngineView(msgspec.Struct):
    model: str
    max_model_len: int
    stats: dict[str, Any]


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
        rows = await queries.find_requests(
            db_session, tenant_id=tenant_id, status=status, since=since, until=until, after=after, limit=limit
        )
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
        return await queries.overview(db_session, services.engine.stats())
