"""`/v1/adapters` (inference scope): a tenant uploads, lists, reads, downloads, disables and deletes its LoRA
adapters; `/admin/tenants/{tenant_id}/adapters` (admin scope): the same upload and listing for a tenant.

Every tenant route is scoped to the caller's tenant (`service.tenant_adapters`): another tenant's adapter id
answers 404, exactly like a missing or deleted one. A request runs under an adapter by naming `<base>:<name>` as
its `model`.
"""

from __future__ import annotations

from typing import Annotated

import anyio
from litestar import Controller, Request, Response, delete, get, patch, post
from litestar.enums import RequestEncodingType
from litestar.params import Body, FromPath, FromQuery, QueryParameter
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.engine.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from pagewise.platform.adapters.schemas import (
    AdapterDeleted,
    AdapterList,
    AdapterObject,
    AdapterUpdate,
    adapter_object,
)
from pagewise.platform.adapters.service import (
    AdapterUpload,
    adapter_store,
    delete_adapter,
    get_adapter,
    register_adapter,
    tenant_adapters,
)
from pagewise.platform.bodies import StrictBody, parse_body
from pagewise.platform.db.models import Adapter, Tenant
from pagewise.platform.db.session import DbSession
from pagewise.platform.errors import not_found
from pagewise.platform.keys.auth import Principal, requires_scope
from pagewise.platform.pages import page_fields
from pagewise.platform.services import Services

UPLOAD_CEILING_BYTES = 2**30  # what the server reads of an upload at most; `PAGEWISE_MAX_ADAPTER_BYTES` is below it
ListLimit = Annotated[int, QueryParameter(ge=1, le=1_000)]
Upload = Annotated[AdapterUpload, Body(media_type=RequestEncodingType.MULTI_PART)]


async def _page(session: AsyncSession, tenant_id: str, after: str | None, limit: int) -> AdapterList:
    query = tenant_adapters(tenant_id)
    if after is not None:
        query = query.where(Adapter.id < after)
    rows = list(await session.scalars(query.order_by(Adapter.id.desc()).limit(limit + 1)))
    return AdapterList(**page_fields([adapter_object(r) for r in rows[:limit]], len(rows), limit))


class AdapterController(Controller):
    path = "/v1/adapters"
    guards = [requires_scope("inference")]
    tags = ["adapters"]

    @post("/", status_code=200, request_max_body_size=UPLOAD_CEILING_BYTES)
    async def upload(
        self, data: Upload, request: Request[Principal, str, object], services: Services, db_session: DbSession
    ) -> AdapterObject:
        """Register a LoRA adapter in PEFT's format (multipart fields `name`, `config` = adapter_config.json,
        `weights` = adapter_model.safetensors, optional `model` = the base model); checked against the base model
        before anything is stored."""
        return adapter_object(await register_adapter(db_session, services, request.user.tenant_id, data))

    @get("/")
    async def list_adapters(
        self,
        request: Request[Principal, str, object],
        db_session: DbSession,
        after: FromQuery[str | None] = None,
        limit: ListLimit = 100,
    ) -> AdapterList:
        """The caller's adapters, newest first; `after` (a `last_id`) continues the listing."""
        return await _page(db_session, request.user.tenant_id, after, limit)

    @get("/{adapter_id:str}")
    async def retrieve(
        self, adapter_id: FromPath[str], request: Request[Principal, str, object], db_session: DbSession
    ) -> AdapterObject:
        return adapter_object(await get_adapter(db_session, request.user.tenant_id, adapter_id))

    @get("/{adapter_id:str}/files/{filename:str}", media_type="application/octet-stream")
    async def download(
        self,
        adapter_id: FromPath[str],
        filename: FromPath[str],
        request: Request[Principal, str, object],
        services: Services,
        db_session: DbSession,
    ) -> Response[bytes]:
        """One of the adapter's two files (`adapter_config.json`, `adapter_model.safetensors`), as uploaded."""
        row = await get_adapter(db_session, request.user.tenant_id, adapter_id)
        if filename not in (CONFIG_FILE, WEIGHTS_FILE):
            raise not_found("adapter file", filename)
        content = await anyio.to_thread.run_sync(adapter_store(services).read, row.digest, filename)
        return Response(content, media_type="application/octet-stream")

    @patch("/{adapter_id:str}")
    async def update(
        self,
        adapter_id: FromPath[str],
        data: StrictBody[AdapterUpdate],
        request: Request[Principal, str, object],
        db_session: DbSession,
    ) -> AdapterObject:
        """Disable (requests under it are refused; it stays listed) or enable it again."""
        change = parse_body(data, AdapterUpdate)
        row = await get_adapter(db_session, request.user.tenant_id, adapter_id)
        row.status = change.status
        await db_session.commit()
        return adapter_object(row)

    @delete("/{adapter_id:str}", status_code=200)
    async def delete_one(
        self,
        adapter_id: FromPath[str],
        request: Request[Principal, str, object],
        services: Services,
        db_session: DbSession,
    ) -> AdapterDeleted:
        """Delete it: requests can no longer name it; its usage stays in `/v1/usage`."""
        row = await get_adapter(db_session, request.user.tenant_id, adapter_id)
        await delete_adapter(db_session, services, row)
        return AdapterDeleted(id=row.id)


class AdminAdapterController(Controller):
    path = "/admin/tenants/{tenant_id:str}/adapters"
    guards = [requires_scope("admin")]
    tags = ["admin"]

    @post("/", status_code=200, request_max_body_size=UPLOAD_CEILING_BYTES)
    async def upload_for_tenant(
        self, tenant_id: FromPath[str], data: Upload, services: Services, db_session: DbSession
    ) -> AdapterObject:
        """Register an adapter for the tenant (the same checks as the tenant's own upload)."""
        await _existing_tenant(db_session, tenant_id)
        return adapter_object(await register_adapter(db_session, services, tenant_id, data))

    @get("/")
    async def list_for_tenant(
        self,
        tenant_id: FromPath[str],
        db_session: DbSession,
        after: FromQuery[str | None] = None,
        limit: ListLimit = 100,
    ) -> AdapterList:
        await _existing_tenant(db_session, tenant_id)
        return await _page(db_session, tenant_id, after, limit)


async def _existing_tenant(session: AsyncSession, tenant_id: str) -> None:
    if await session.get(Tenant, tenant_id) is None:
        raise not_found("tenant", tenant_id)
