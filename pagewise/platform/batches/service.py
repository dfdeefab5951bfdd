"""Creating, reading and cancelling batches.

Invariants: a batch is created only from a file of the caller's tenant that exists and is not deleted, whose every
line names the batch's endpoint and carries a body that endpoint would accept (parsed and prepared as the endpoint
would: tokenized, checked against the engine's and the key's limits) — else a 400 naming the first bad line, and
nothing is stored. The batch and all its lines are written in one commit. Cancelling marks the lines not yet
started `cancelled` at once; lines already running finish and are kept.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.engine.errors import InvalidRequestError
from pagewise.platform.batches.results import unrun_result
from pagewise.platform.batches.schemas import BatchCreate, BatchObject, RequestCounts
from pagewise.platform.bodies import parse_body
from pagewise.platform.db.ids import new_id
from pagewise.platform.db.models import Batch, BatchLine, StoredFile, as_utc, utcnow
from pagewise.platform.engine_client import EngineClient
from pagewise.platform.errors import APIError, invalid_request, not_found
from pagewise.platform.files.batch_input import BatchInputError, read_batch_input
from pagewise.platform.files.controllers import get_file
from pagewise.platform.files.storage import FileStorage
from pagewise.platform.inference.prompts import PreparedRequest, prepare_chat, prepare_completion
from pagewise.platform.inference.schemas import ChatCompletionRequest, CompletionRequest
from pagewise.platform.keys.auth import Principal

COMPLETION_WINDOW = dt.timedelta(hours=24)
OPEN_STATUSES = ("in_progress", "cancelling", "finalizing")


async def prepare_line(endpoint: str, body: dict, principal: Principal, engine: EngineClient) -> PreparedRequest:
    """A line's body as its endpoint prepares it; an `APIError` (or `InvalidRequestError`) if it would refuse it."""
    if endpoint == "/v1/chat/completions":
        chat = parse_body(body, ChatCompletionRequest)
        if chat.stream:
            raise invalid_request("stream is not supported in a batch", param="stream")
        return await prepare_chat(chat, principal, engine)
    completion = parse_body(body, CompletionRequest)
    if completion.stream:
        raise invalid_request("stream is not supported in a batch", param="stream")
    return await prepare_completion(completion, principal, engine)


async def create_batch(
    session: AsyncSession, storage: FileStorage, engine: EngineClient, principal: Principal, data: BatchCreate
) -> Batch:
    file = await _input_file(session, principal.tenant_id, data.input_file_id)
    try:
        lines = read_batch_input(storage.read(file.tenant_id, file.id))
    except BatchInputError as error:  # checked at upload; a file changed on disk since is refused the same way
        raise invalid_request(f"invalid batch input file: {error}", param="input_file_id") from None
    for line in lines:
        if line.url != data.endpoint:
            raise invalid_request(
                f"line {line.line}: url {line.url!r} is not the batch's endpoint {data.endpoint!r}",
                param="input_file_id",
            )
        try:
            await prepare_line(data.endpoint, line.body, principal, engine)
        except (APIError, InvalidRequestError) as error:
            where = f" ({error.param})" if getattr(error, "param", None) else ""
            message = error.message if isinstance(error, APIError) else str(error)
            raise invalid_request(f"line {line.line}{where}: {message}", param="input_file_id") from None
    now = utcnow()
    batch = Batch(
        id=new_id("batch"),
        tenant_id=principal.tenant_id,
        api_key_id=principal.key_id,
        input_file_id=file.id,
        endpoint=data.endpoint,
        completion_window=data.completion_window,
        batch_metadata=data.metadata,
        status="in_progress",
        created_at=now,
        in_progress_at=now,
        expires_at=now + COMPLETION_WINDOW,
    )
    session.add(batch)
    await session.flush()
    session.add_all(
        BatchLine(batch_id=batch.id, custom_id=line.custom_id, line=line.line, body=line.body, status="pending")
        for line in lines
    )
    await session.commit()
    return batch


async def _input_file(session: AsyncSession, tenant_id: str, file_id: str) -> StoredFile:
    deleted = await session.scalar(
        select(StoredFile).where(
            StoredFile.tenant_id == tenant_id, StoredFile.id == file_id, StoredFile.deleted_at.is_not(None)
        )
    )
    if deleted is not None:
        raise invalid_request(f"file {file_id!r} has been deleted", param="input_file_id")
    try:
        file = await get_file(session, tenant_id, file_id)
    except APIError:
        raise invalid_request(f"No file found with id {file_id!r}", param="input_file_id") from None
    if file.purpose != "batch":
        raise invalid_request(f"file {file_id!r} is not a batch input file", param="input_file_id")
    return file


def tenant_batches(tenant_id: str):
    return select(Batch).where(Batch.tenant_id == tenant_id)


async def get_batch(session: AsyncSession, tenant_id: str, batch_id: str) -> Batch:
    batch = await session.scalar(tenant_batches(tenant_id).where(Batch.id == batch_id))
    if batch is None:
        raise not_found("batch", batch_id)
    return batch


async def cancel_batch(session: AsyncSession, batch: Batch) -> Batch:
    """Stop the lines not yet started (`cancelled`); the batch is `cancelling` until its running lines end."""
    if batch.status != "in_progress":
        if batch.status in ("cancelling", "cancelled"):
            return batch
        raise APIError(409, f"batch {batch.id!r} is {batch.status} and cannot be cancelled", code="conflict")
    batch.status, batch.cancelling_at = "cancelling", utcnow()
    await session.flush()
    await mark_unrun(session, batch.id, "cancelled", "batch_cancelled", "the batch was cancelled before this line ran")
    await session.commit()
    return batch


async def mark_unrun(session: AsyncSession, batch_id: str, status: str, code: str, message: str) -> None:
    """End every pending line of the batch with `status` and an error result (`code`)."""
    pending = await session.scalars(
        select(BatchLine).where(BatchLine.batch_id == batch_id, BatchLine.status == "pending")
    )
    for line in pending:
        line.status, line.result = status, unrun_result(line, code, message)


async def request_counts(session: AsyncSession, batch_id: str) -> RequestCounts:
    counts = dict(
        (await session.execute(
            select(BatchLine.status, func.count()).where(BatchLine.batch_id == batch_id).group_by(BatchLine.status)
        )).all()
    )
    return RequestCounts(
        total=sum(counts.values()), completed=counts.get("succeeded", 0), failed=counts.get("failed", 0)
    )


def _unix(moment: dt.datetime | None) -> int | None:
    return None if moment is None else int(as_utc(moment).timestamp())


async def batch_out(session: AsyncSession, batch: Batch) -> BatchObject:
    return BatchObject(
        id=batch.id,
        endpoint=batch.endpoint,
        input_file_id=batch.input_file_id,
        completion_window=batch.completion_window,
        status=batch.status,
        output_file_id=batch.output_file_id,
        error_file_id=batch.error_file_id,
        created_at=int(as_utc(batch.created_at).timestamp()),
        in_progress_at=_unix(batch.in_progress_at),
        expires_at=int(as_utc(batch.expires_at).timestamp()),
        finalizing_at=_unix(batch.finalizing_at),
        completed_at=_unix(batch.completed_at),
        failed_at=None,
        expired_at=_unix(batch.expired_at),
        cancelling_at=_unix(batch.cancelling_at),
        cancelled_at=_unix(batch.cancelled_at),
        request_counts=await request_counts(session, batch.id),
        metadata=batch.batch_metadata,
    )

