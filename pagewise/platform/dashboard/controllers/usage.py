"""Usage: tokens per day or hour, stacked by tenant or model, from the same `usage_page` as `GET /admin/usage`;
per-key totals over the same range; and the page's data as CSV."""

from __future__ import annotations

import datetime as dt
import time
from typing import get_args

import msgspec
from litestar import Controller, Request, Response, get
from litestar.response import Template
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.dashboard.access import Admin
from pagewise.platform.dashboard.key_usage import usage_by_key
from pagewise.platform.dashboard.pages import render
from pagewise.platform.dashboard.usage_view import usage_chart, usage_csv
from pagewise.platform.db.session import DbSession
from pagewise.platform.errors import invalid_request
from pagewise.platform.keys.service import KeyService
from pagewise.platform.tenants.service import TenantService
from pagewise.platform.usage.service import BucketWidth, GroupField, UsagePage, usage_page

RANGES = ("short", "medium", "long")
SPANS: dict[str, tuple[int, ...]] = {"1d": (7, 14, 31), "1h": (24, 48, 168)}  # buckets each range shows
BUCKET_SECONDS = {"1d": 86400, "1h": 3600}
GROUPS: tuple[str, ...] = get_args(GroupField)


class UsageQuery(msgspec.Struct, frozen=True, kw_only=True):
    """What a usage page shows; `from_params` refuses anything else with a 400 naming the parameter."""

    bucket_width: BucketWidth = "1d"
    range: str = "short"  # one of RANGES, whatever the width: switching widths keeps a valid range
    group_by: GroupField | None = "tenant_id"
    tenant_id: str | None = None

    @classmethod
    def from_params(cls, params: dict[str, str]) -> UsageQuery:
        width = params.get("bucket_width") or "1d"
        if width not in SPANS:
            raise invalid_request(f"bucket_width must be 1d or 1h; got {width!r}", param="bucket_width")
        span = params.get("range") or RANGES[0]
        if span not in RANGES:
            raise invalid_request(f"range must be one of {', '.join(RANGES)}; got {span!r}", param="range")
        group = params.get("group_by", "tenant_id")
        if group not in (*GROUPS, ""):
            raise invalid_request(f"group_by must be tenant_id, model or empty; got {group!r}", param="group_by")
        tenant_id = params.get("tenant_id") or None
        return cls(bucket_width=width, range=span, group_by=group or None, tenant_id=tenant_id)

    @property
    def span(self) -> int:
        """How many buckets the range holds."""
        return SPANS[self.bucket_width][RANGES.index(self.range)]

    def start_time(self) -> int:
        """The range ends now and holds `span` buckets (the service floors the start to a bucket)."""
        return int(time.time()) - (self.span - 1) * BUCKET_SECONDS[self.bucket_width]


async def _page(db_session: AsyncSession, query: UsageQuery) -> UsagePage:
    group_by = [query.group_by] if query.group_by else []
    return await usage_page(
        db_session,
        start_time=query.start_time(),
        end_time=None,
        width=query.bucket_width,
        group_by=group_by,
        tenant_id=query.tenant_id,
    )


class UsagePages(Controller):
    @get("/usage")
    async def show(self, request: Request, admin: Admin, db_session: DbSession) -> Template:
        query = UsageQuery.from_params(dict(request.query_params))
        page = await _page(db_session, query)
        tenants = {t.id: t.name for t in await TenantService(db_session).list()}
        since = dt.datetime.fromtimestamp(page.data[0].start_time, dt.UTC)
        by_key = await usage_by_key(db_session, since, tenant_id=query.tenant_id)
        keys = {k.id: k for k in await KeyService(db_session).list()}
        return await render(
            request,
            admin,
            "usage.html",
            page="usage",
            query=query,
            ranges=[(name, SPANS[query.bucket_width][i]) for i, name in enumerate(RANGES)],
            tenants=tenants,
            chart=usage_chart(page, query.bucket_width, query.group_by, lambda k: tenants.get(k, k)),
            by_key=sorted(by_key.items(), key=lambda item: -(item[1].input_tokens + item[1].output_tokens)),
            keys=keys,
            csv_query=request.url.query,
        )

    @get("/usage.csv")
    async def download(self, request: Request, db_session: DbSession) -> Response[str]:
        query = UsageQuery.from_params(dict(request.query_params))
        body = usage_csv(await _page(db_session, query))
        name = f"pagewise-usage-{query.bucket_width}-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}.csv"
        return Response(body, media_type="text/csv", headers={"content-disposition": f'attachment; filename="{name}"'})
