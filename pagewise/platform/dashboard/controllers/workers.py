"""The engine workers and their live load, as `GET /admin/workers` lists them (`admin.workers.live_workers`)."""

from __future__ import annotations

import time

from litestar import Controller, Request, get
from litestar.response import Template

from pagewise.platform.admin.workers import live_workers
from pagewise.platform.dashboard.access import Admin
from pagewise.platform.dashboard.pages import render
from pagewise.platform.services import Services


class WorkerPages(Controller):
    path = "/workers"

    @get("/")
    async def show(self, request: Request, admin: Admin, services: Services) -> Template:
        return await render(
            request, admin, "workers.html", page="workers", workers=live_workers(services), now=time.time()
        )
