"""Tenants: list, create, edit name, quotas and weight, suspend and reactivate — through `TenantService`, so the
dashboard refuses exactly what the API refuses (bounds, duplicate names, suspending the last admin tenant).

A tenant's page lists its live adapters (`adapters.service.tenant_adapters`: never a deleted one) with this UTC
month's usage of each adapter's model name, read from the same `usage_page` as the usage page; and its newest
batches (`batches.service.tenant_batches`, shaped by `batch_out` as the Batch API returns them: request counts
included), read-only."""

from __future__ import annotations

import datetime as dt
from urllib.parse import quote

from litestar import Controller, Request, get, post
from litestar.params import FromPath
from litestar.response import Redirect, Template
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.adapters.schemas import AdapterObject, adapter_object
from pagewise.platform.adapters.service import tenant_adapters
from pagewise.platform.batches.schemas import BatchObject
from pagewise.platform.batches.service import batch_out, tenant_batches
from pagewise.platform.dashboard.access import Admin
from pagewise.platform.dashboard.forms import SCOPES, tenant_create, tenant_status, tenant_update
from pagewise.platform.dashboard.key_usage import usage_by_key
from pagewise.platform.dashboard.pages import back, refused, render
from pagewise.platform.dashboard.usage_view import usage_totals
from pagewise.platform.db.models import Adapter, Batch
from pagewise.platform.db.session import DbSession
from pagewise.platform.errors import APIError
from pagewise.platform.keys.service import KeyService, key_out
from pagewise.platform.tenants.schemas import QUOTA_BOUNDS, TenantCreate
from pagewise.platform.tenants.service import TenantService
from pagewise.platform.usage.service import UsageResult, usage_page

KEY_USAGE_WINDOW = dt.timedelta(days=30)
BATCHES_SHOWN = 20
QUOTA_LABELS = {field: field.replace("_", " ").capitalize() for field in QUOTA_BOUNDS}  # form order and labels


async def _adapters(session: AsyncSession, tenant_id: str) -> tuple[list[AdapterObject], dict[str, UsageResult]]:
    """`tenant_id`'s live adapters, newest first, and model name → its usage since this UTC month began (only
    models used this month are keys; no usage query when there are no adapters)."""
    rows = await session.scalars(tenant_adapters(tenant_id).order_by(Adapter.id.desc()))
    adapters = [adapter_object(row) for row in rows]
    if not adapters:
        return adapters, {}
    month = dt.datetime.now(dt.UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    page = await usage_page(
        session, start_time=int(month.timestamp()), end_time=None, width="1d", group_by=["model"], tenant_id=tenant_id
    )
    return adapters, usage_totals(page, "model")


async def _batches(session: AsyncSession, tenant_id: str) -> tuple[list[BatchObject], bool]:
    """`tenant_id`'s newest `BATCHES_SHOWN` batches, newest first (ids sort by creation), and whether it has more."""
    rows = list(await session.scalars(tenant_batches(tenant_id).order_by(Batch.id.desc()).limit(BATCHES_SHOWN + 1)))
    return [await batch_out(session, row) for row in rows[:BATCHES_SHOWN]], len(rows) > BATCHES_SHOWN


class TenantPages(Controller):
    path = "/tenants"

    @get("/")
    async def list_tenants(self, request: Request, admin: Admin, db_session: DbSession) -> Template:
        return await render(
            request,
            admin,
            "tenants.html",
            page="tenants",
            tenants=await TenantService(db_session).list(),
            defaults=TenantCreate(name=""),
            quota_labels=QUOTA_LABELS,
        )

    @post("/")
    async def create(self, request: Request, admin: Admin, db_session: DbSession) -> Redirect:
        try:
            tenant = await TenantService(db_session).create(tenant_create(await request.form()))
        except APIError as error:
            return await refused(request, admin, "/tenants", error)
        return await back(request, admin, f"/tenants/{quote(tenant.id, safe='')}", f"Created tenant {tenant.name}.")

    @get("/{tenant_id:str}")
    async def show(self, request: Request, admin: Admin, db_session: DbSession, tenant_id: FromPath[str]) -> Template:
        tenant = await TenantService(db_session).get(tenant_id)
        keys = [key_out(k) for k in await KeyService(db_session).list(tenant_id)]
        since = dt.datetime.now(dt.UTC) - KEY_USAGE_WINDOW
        adapters, adapter_usage = await _adapters(db_session, tenant_id)
        batches, more_batches = await _batches(db_session, tenant_id)
        return await render(
            request,
            admin,
            "tenant.html",
            page="tenants",
            tenant=tenant,
            keys=keys,
            usage=await usage_by_key(db_session, since, tenant_id=tenant_id),
            usage_days=KEY_USAGE_WINDOW.days,
            adapters=adapters,
            adapter_usage=adapter_usage,
            batches=batches,
            more_batches=more_batches,
            batches_shown=BATCHES_SHOWN,
            quota_labels=QUOTA_LABELS,
            scopes=SCOPES,
        )

    @post("/{tenant_id:str}")
    async def update(self, request: Request, admin: Admin, db_session: DbSession, tenant_id: FromPath[str]) -> Redirect:
        here = f"/tenants/{quote(tenant_id, safe='')}"
        try:
            tenant = await TenantService(db_session).update(tenant_id, tenant_update(await request.form()))
        except APIError as error:
            return await refused(request, admin, here, error)
        return await back(request, admin, here, f"Saved tenant {tenant.name}.")

    @post("/{tenant_id:str}/status")
    async def set_status(
        self, request: Request, admin: Admin, db_session: DbSession, tenant_id: FromPath[str]
    ) -> Redirect:
        here = f"/tenants/{quote(tenant_id, safe='')}"
        try:
            tenant = await TenantService(db_session).update(tenant_id, tenant_status(await request.form()))
        except APIError as error:
            return await refused(request, admin, here, error)
        return await back(request, admin, here, f"Tenant {tenant.name} is {tenant.status}.")
