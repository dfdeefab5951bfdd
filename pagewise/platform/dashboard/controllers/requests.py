"""Requests across tenants: search by tenant, status, time (UTC) and id, newest first, 50 a page; and one
request in full (timings, usage with cached tokens, parameters, input, output, error)."""

from __future__ import annotations

import json
from urllib.parse import quote, urlencode

from litestar import Controller, Request, get
from litestar.params import FromPath
from litestar.response import Redirect, Template

from pagewise.platform.admin.queries import find_requests
from pagewise.platform.dashboard.access import Admin
from pagewise.platform.dashboard.forms import request_status, utc_time
from pagewise.platform.dashboard.pages import render
from pagewise.platform.db.models import RequestRecord
from pagewise.platform.db.session import DbSession
from pagewise.platform.errors import not_found
from pagewise.platform.keys.auth import DASHBOARD_PATH
from pagewise.platform.requests.schemas import request_out
from pagewise.platform.tenants.service import TenantService
from pagewise.serving.protocol import RequestStatus

PAGE_SIZE = 50
FILTERS = ("tenant_id", "status", "since", "until")


class RequestPages(Controller):
    path = "/requests"

    @get("/")
    async def search(self, request: Request, admin: Admin, db_session: DbSession) -> Template | Redirect:
        params = {k: v.strip() for k, v in request.query_params.items() if isinstance(v, str)}
        request_id = params.get("id", "")
        if request_id and await db_session.get(RequestRecord, request_id) is not None:
            return Redirect(f"{DASHBOARD_PATH}/requests/{quote(request_id, safe='')}", status_code=303)
        rows = (
            []
            if request_id
            else await find_requests(
                db_session,
                tenant_id=params.get("tenant_id") or None,
                status=request_status(params.get("status", "")),
                since=utc_time(params.get("since", ""), "since"),
                until=utc_time(params.get("until", ""), "until"),
                after=params.get("after") or None,
                limit=PAGE_SIZE,
            )
        )
        filters = {k: params[k] for k in FILTERS if params.get(k)}
        more = len(rows) > PAGE_SIZE
        return await render(
            request,
            admin,
            "requests.html",
            page="requests",
            rows=[request_out(r) for r in rows[:PAGE_SIZE]],
            params=params,
            missing_id=request_id or None,
            next_query=urlencode({**filters, "after": rows[PAGE_SIZE - 1].id}) if more else None,
            tenants={t.id: t.name for t in await TenantService(db_session).list()},
            statuses=[s.value for s in RequestStatus],
        )

    @get("/{request_id:str}")
    async def show(self, request: Request, admin: Admin, db_session: DbSession, request_id: FromPath[str]) -> Template:
        row = await db_session.get(RequestRecord, request_id)
        if row is None:
            raise not_found("request", request_id)
        tenant = await TenantService(db_session).get(row.tenant_id)
        return await render(
            request,
            admin,
            "request.html",
            page="requests",
            r=request_out(row),
            tenant=tenant,
            as_json=lambda value: json.dumps(value, indent=2, ensure_ascii=False),
        )
