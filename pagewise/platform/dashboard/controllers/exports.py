"""Billing exports: every revision the jobs worker wrote, newest first, with its files to download."""

from __future__ import annotations

from typing import Literal

from litestar import Controller, Request, Response, get
from litestar.params import FromPath
from litestar.response import Template

from pagewise.platform.billing.exports import export_file, recent_exports
from pagewise.platform.dashboard.access import Admin
from pagewise.platform.dashboard.pages import render
from pagewise.platform.db.session import DbSession
from pagewise.platform.services import Services


class ExportPages(Controller):
    path = "/exports"

    @get("/")
    async def show(self, request: Request, admin: Admin, db_session: DbSession, services: Services) -> Template:
        exports = await recent_exports(db_session)
        return await render(
            request, admin, "exports.html", page="exports", exports=exports, export_dir=services.settings.export_path
        )

    @get("/{export_id:str}/{kind:str}")
    async def download(
        self,
        export_id: FromPath[str],
        kind: FromPath[Literal["csv", "jsonl"]],
        admin: Admin,
        db_session: DbSession,
        services: Services,
    ) -> Response[bytes]:
        return await export_file(db_session, services.settings, export_id, kind)
