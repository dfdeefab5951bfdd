"""`/v1/requests` (inference scope): submit a completion to run in the background, poll, cancel, list.

Every query is scoped to the caller's tenant: another tenant's id answers 404, exactly like a missing one.
"""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, Request, delete, get, post
from litestar.params import FromPath, FromQuery, QueryParameter
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.bodies import StrictBody, parse_body
from pagewise.platform.db.models import UNFINISHED_STATUSES, RequestRecord
from pagewise.platform.db.session import DbSession
from pagewise.platform.errors import invalid_request, not_found
from pagewise.platform.inference.job import InferenceJob, wait_ended
from pagewise.platform.inference.prompts import prepare_chat, prepare_completion
from pagewise.platform.inference.schemas import AsyncChatRequest, AsyncRequest
from pagewise.platform.keys.auth import Principal, requires_scope
from pagewise.platform.requests.schemas import RequestList, RequestOut, request_out, request_page
from pagewise.platform.requests.store import newest_first, tenant_requests
from pagewise.platform.services import Services

CANCEL_WAIT_S = 30.0  # how long DELETE waits for the engine to write the cancelled row
PageLimit = Annotated[int, QueryParameter(ge=1, le=100)]


async def _get_row(session: AsyncSession, tenant_id: str, request_id: str) -> RequestRecord:
    row = await session.scalar(tenant_requests(tenant_id).where(RequestRecord.id == request_id))
    if row is None:
        raise not_found("request", request_id)
    return row


class RequestController(Controller):
    path = "/v1/requests"
    guards = [requires_scope("inference")]
    tags = ["requests"]

    @post("/", status_code=202)
    async def submit(
        self, data: StrictBody[AsyncRequest], request: Request[Principal, str, object], services: Services
    ) -> RequestOut:
        """Same body as chat or completions plus `endpoint`; returns the queued request at once."""
        body = parse_body(data, AsyncRequest)
        await InferenceJob.precheck(services, request.user)
        if isinstance(body, AsyncChatRequest):
            prepared = await prepare_chat(body, request.user, services.engine)
        else:
            prepared = await prepare_completion(body, request.user, services.engine)
        if prepared.stream:
            raise invalid_request("stream is not supported for asynchronous requests", param="stream")
        job = await InferenceJob.admit(services, request.user, prepared)  # an engine runs it, durably: no reader
        async with services.sessionmaker() as session:
            return request_out(await _get_row(session, request.user.tenant_id, job.id))

    @get("/")
    async def list_requests(
        self,
        request: Request[Principal, str, object],
        db_session: DbSession,
        after: FromQuery[str | None] = None,
        limit: PageLimit = 20,
    ) -> RequestList:
        """The caller's requests, newest first; `after` (a `last_id`) must name one of them."""
        rows = await newest_first(db_session, tenant_requests(request.user.tenant_id), after=after, limit=limit)
        return request_page(rows, limit)

    @get("/{request_id:str}")
    async def get_request(
        self, request_id: FromPath[str], request: Request[Principal, str, object], db_session: DbSession
    ) -> RequestOut:
        return request_out(await _get_row(db_session, request.user.tenant_id, request_id))

    @delete("/{request_id:str}", status_code=200)
    async def cancel_request(
        self, request_id: FromPath[str], request: Request[Principal, str, object], services: Services
    ) -> RequestOut:
        """Cancel a queued or running request, billing the tokens generated so far; finished ones stay."""
        tenant_id = request.user.tenant_id
        async with services.sessionmaker() as session:
            row = await _get_row(session, tenant_id, request_id)  # 404 before touching anything
        if row.status in UNFINISHED_STATUSES:
            await services.engine.transport.abort(request_id)
            await wait_ended(services, request_id, CANCEL_WAIT_S)
        async with services.sessionmaker() as session:
            return request_out(await _get_row(session, tenant_id, request_id))
