"""The overview: the last 24 hours (requests by status, tokens, errors, top tenants, tokens per hour) and the
engine's live state, which the page refreshes from `GET /live`."""

from __future__ import annotations

import time

from litestar import Controller, Request, get
from litestar.response import Template

from pagewise.platform.admin.queries import OVERVIEW_WINDOW, overview
from pagewise.platform.dashboard.access import Admin
from pagewise.platform.dashboard.live import LiveStats, live_stats
from pagewise.platform.dashboard.pages import render
from pagewise.platform.dashboard.usage_view import usage_chart
from pagewise.platform.db.session import DbSession
from pagewise.platform.services import Services
from pagewise.platform.usage.service import usage_page
from pagewise.serving.protocol import RequestStatus


class OverviewController(Controller):
    path = "/"

    @get("/")
    async def show(self, request: Request, admin: Admin, db_session: DbSession, services: Services) -> Template:
        live = live_stats(services)
        summary = await overview(db_session, services.engine.stats())
        start = int(time.time() - OVERVIEW_WINDOW.total_seconds())
        hourly = await usage_page(db_session, start_time=start, end_time=None, width="1h", group_by=[], tenant_id=None)
        return await render(
            request,
            admin,
            "overview.html",
            page="overview",
            summary=summary,
            statuses=[s.value for s in RequestStatus],
            live=live,
            chart=usage_chart(hourly, "1h", None, str),
        )

    @get("/live")
    async def live(self, services: Services) -> LiveStats:
        """The live figures as JSON, for the page's refresh script."""
        return live_stats(services)
