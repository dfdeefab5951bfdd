"""`/admin/exports` (admin scope): list export revisions, queue an export, download a revision's files.

Exports are made by `pagewise jobs worker`; `POST` only queues one (202) after checking the tenant and the period,
so a bad request is a 400/404 and queues nothing. Without `PAGEWISE_REDIS_URL` there is no job queue: 503.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

import anyio
import msgspec
from litestar import Controller, Response, get, post
from litestar.params import FromPath, FromQuery, QueryParameter
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.billing.export_files import ExportError, export_paths, month_bounds
from pagewise.platform.bodies import StrictBody, parse_body
from pagewise.platform.db.models import BillingExport, as_utc
from pagewise.platform.db.session import DbSession
from pagewise.platform.errors import APIError, invalid_request, not_found
from pagewise.platform.keys.auth import requires_scope
from pagewise.platform.services import Services
from pagewise.platform.settings import Settings
from pagewise.platform.tenants.service import TenantService

_MEDIA = {"csv": "text/csv", "jsonl": "application/x-ndjson"}


class ExportCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tenant_id: str
    period: str  # YYYY-MM


class ExportQueued(msgspec.Struct, kw_only=True):
    task_id: str
    tenant_id: str
    period: str


class ExportOut(msgspec.Struct, kw_only=True):
    id: str
    tenant_id: str
    period: str
    revision: int
    num_rows: int
    total_cost_micros: int
    csv_sha256: str
    jsonl_sha256: str
    created_at: dt.datetime


def export_out(export: BillingExport) -> ExportOut:
    out = ExportOut(**{f: getattr(export, f) for f in ExportOut.__struct_fields__})
    out.created_at = as_utc(out.created_at)
    return out


def _queue(settings: Settings, tenant_id: str, period: str) -> str:
    """Queue the export task (blocking: run in a thread); its id."""
    from pagewise.jobs.celery_app import configure

    return configure(settings).send_task("pagewise.export_month", args=[tenant_id, period]).id


class ExportController(Controller):
    path = "/admin/exports"
    guards = [requires_scope("admin")]
    tags = ["admin", "billing"]

    @get("/")
    async def list_exports(
        self,
        db_session: DbSession,
        tenant_id: FromQuery[str | None] = None,
        period: FromQuery[str | None] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=500)] = 100,
    ) -> list[ExportOut]:
        """Revisions newest first."""
        return await recent_exports(db_session, tenant_id=tenant_id, period=period, limit=limit)

    @post("/", status_code=202)
    async def queue_export(
        self, data: StrictBody[ExportCreate], db_session: DbSession, services: Services
    ) -> ExportQueued:
        body = parse_body(data, ExportCreate)
        await TenantService(db_session).get(body.tenant_id)
        try:
            month_bounds(body.period, dt.datetime.now(dt.UTC).date())
        except ExportError as error:
            raise invalid_request(str(error), param="period") from None
        if services.settings.redis_url is None:
            raise APIError(
                503,
                "Billing exports run in `pagewise jobs worker`, which needs PAGEWISE_REDIS_URL",
                code="jobs_unavailable",
            )
        task_id = await anyio.to_thread.run_sync(_queue, services.settings, body.tenant_id, body.period)
        return ExportQueued(task_id=task_id, tenant_id=body.tenant_id, period=body.period)

    @get("/{export_id:str}/{kind:str}")
    async def download(
        self,
        export_id: FromPath[str],
        kind: FromPath[Literal["csv", "jsonl"]],
        db_session: DbSession,
        services: Services,
    ) -> Response[bytes]:
        """A revision's CSV or JSONL file; `x-content-sha256` is the hash the revision records."""
        return await export_file(db_session, services.settings, export_id, kind)


async def export_file(
    session: AsyncSession, settings: Settings, export_id: str, kind: Literal["csv", "jsonl"]
) -> Response[bytes]:
    """The download of one revision's file (the API's and the dashboard's): 404 for an unknown export or a file
    missing from the export directory; `x-content-sha256` is the hash the revision records."""
    export = await session.get(BillingExport, export_id)
    if export is None:
        raise not_found("export", export_id)
    csv_path, jsonl_path = export_paths(settings.export_path, export)
    path, digest = (csv_path, export.csv_sha256) if kind == "csv" else (jsonl_path, export.jsonl_sha256)
    try:
        content = await anyio.Path(path).read_bytes()
    except FileNotFoundError:
        raise APIError(
            404,
            f"The {kind} file of export '{export_id}' is missing from the export directory",
            code="export_file_missing",
        ) from None
    name = f"pagewise-{export.tenant_id}-{export.period}-r{export.revision}.{kind}"
    headers = {"content-disposition": f'attachment; filename="{name}"', "x-content-sha256": digest}
    return Response(content, media_type=_MEDIA[kind], headers=headers)


async def recent_exports(
    session: AsyncSession, *, tenant_id: str | None = None, period: str | None = None, limit: int = 100
) -> list[ExportOut]:
    """Revisions newest first (the API's list and the dashboard's page)."""
    query = select(BillingExport).order_by(BillingExport.created_at.desc(), BillingExport.id.desc()).limit(limit)
    if tenant_id is not None:
        query = query.where(BillingExport.tenant_id == tenant_id)
    if period is not None:
        query = query.where(BillingExport.period == period)
    return [export_out(e) for e in (await session.scalars(query)).all()]
