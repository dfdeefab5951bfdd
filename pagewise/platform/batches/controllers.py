"""`/v1/batches` (inference scope): create a batch from an uploaded file, read, list and cancel the caller's batches.
Another tenant's batch id answers 404, exactly like a missing one; the lines run in the background
(`runner.py`)."""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, Request, get, post
from litestar.params import FromPath, FromQuery, QueryParameter

from pagewise.platform.batches.schemas import BatchCreate, BatchList, BatchObject
from pagewise.platform.batches.service import batch_out, cancel_batch, create_batch, get_batch, tenant_batches
from pagewise.platform.bodies import StrictBody, parse_body
from pagewise.platform.db.models import Batch
from pagewise.platform.db.session import DbSession
from pagewise.platform.files.controllers import storage
from pagewise.platform.keys.auth import Principal, requires_scope
from pagewise.platform.pages import page_fields
from pagewise.platform.services import Services

PageLimit = Annotated[int, QueryParameter(ge=1, le=100)]


class BatchController(Controller):
    path = "/v1/batches"
    guards = [requires_scope("inference")]
    tags = ["batches"]

    @post("/", status_code=200)
    async def create(
        self,
        data: StrictBody[BatchCreate],
        request: Request[Principal, str, object],
        services: Services,
        db_session: DbSession,
    ) -> BatchObject:
        """A batch of the file's requests; every line is checked first (a 400 names the first bad one)."""
        body = parse_body(data, BatchCreate)
        batch = await create_batch(db_session, storage(services), services.engine, request.user, body)
        services.batch_created.set()
        return await batch_out(db_session, batch)

    @get("/")
    async def list_batches(
        self,
        request: Request[Principal, str, object],
        db_session: DbSession,
        after: FromQuery[str | None] = None,
        limit: PageLimit = 20,
    ) -> BatchList:
        """The caller's batches, newest first (ids are time-ordered); `after` (a `last_id`) continues."""
        query = tenant_batches(request.user.tenant_id)
        if after is not None:
            query = query.where(Batch.id < after)
        rows = list(await db_session.scalars(query.order_by(Batch.id.desc()).limit(limit + 1)))
        page = [await batch_out(db_session, b) for b in rows[:limit]]
        return BatchList(**page_fields(page, len(rows), limit))

    @get("/{batch_id:str}")
    async def retrieve(
        self, batch_id: FromPath[str], request: Request[Principal, str, object], db_session: DbSession
    ) -> BatchObject:
        return await batch_out(db_session, await get_batch(db_session, request.user.tenant_id, batch_id))

    @post("/{batch_id:str}/cancel", status_code=200)
    async def cancel(
        self, batch_id: FromPath[str], request: Request[Principal, str, object], db_session: DbSession
    ) -> BatchObject:
        """Stop the lines not yet started; running ones finish and are kept (`cancelling`, then `cancelled`)."""
        batch = await cancel_batch(db_session, await get_batch(db_session, request.user.tenant_id, batch_id))
        return await batch_out(db_session, batch)
