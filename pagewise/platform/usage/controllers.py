"""`GET /v1/usage` (inference scope): the caller's own usage in OpenAI Usage-API-shaped daily buckets."""

from __future__ import annotations

import time

from litestar import Controller, Request, get
from litestar.params import FromQuery

from pagewise.platform.db.session import DbSession
from pagewise.platform.keys.auth import Principal, requires_scope
from pagewise.platform.usage.service import BucketWidth, TenantGroupField, UnixTime, UsagePage, usage_page

DEFAULT_RANGE_S = 7 * 86400


class UsageController(Controller):
    path = "/v1/usage"
    guards = [requires_scope("inference")]
    tags = ["usage"]

    @get("/")
    async def get_usage(
        self,
        request: Request[Principal, str, object],
        db_session: DbSession,
        start_time: UnixTime = None,
        end_time: UnixTime = None,
        bucket_width: FromQuery[BucketWidth] = "1d",
        group_by: FromQuery[list[TenantGroupField] | None] = None,
    ) -> UsagePage:
        """Buckets from `start_time` (unix seconds; default a week ago) to `end_time` (default now)."""
        start = start_time if start_time is not None else int(time.time()) - DEFAULT_RANGE_S
        return await usage_page(
            db_session,
            start_time=start,
            end_time=end_time,
            width=bucket_width,
            group_by=group_by or [],
            tenant_id=request.user.tenant_id,
        )
