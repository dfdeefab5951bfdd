"""`/v1/files` (inference scope): upload a batch input file, list, read, download and delete the caller's files.

Every query is scoped to the caller's tenant: another tenant's file id answers 404, exactly like a missing or
deleted one. An upload is checked whole before anything is stored (size, purpose, the batch input shape of
`batch_input.py`), so a refused upload leaves no row and no bytes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Annotated, Literal

import anyio
from litestar import Controller, Request, Response, delete, get, post
from litestar.datastructures import UploadFile
from litestar.enums import RequestEncodingType
from litestar.params import Body, FromPath, FromQuery, QueryParameter
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.db.ids import new_id
from pagewise.platform.db.models import StoredFile, utcnow
from pagewise.platform.db.session import DbSession
from pagewise.platform.errors import invalid_request, not_found
from pagewise.platform.files.batch_input import BatchInputError, read_batch_input
from pagewise.platform.files.schemas import FileDeleted, FileList, FileObject, file_object
from pagewise.platform.files.storage import FileStorage
from pagewise.platform.keys.auth import Principal, requires_scope
from pagewise.platform.pages import page_fields
from pagewise.platform.services import Services

UPLOAD_CEILING_BYTES = 2**30  # what the server reads of an upload at most; `PAGEWISE_MAX_FILE_BYTES` is below it
MAX_FILENAME_CHARS = 256
ListLimit = Annotated[int, QueryParameter(ge=1, le=10_000)]


@dataclass
class FileUpload:
    file: UploadFile
    purpose: str


def tenant_files(tenant_id: str):
    """Every query for a caller's files starts here: another tenant's, and deleted ones, are never visible."""
    return select(StoredFile).where(StoredFile.tenant_id == tenant_id, StoredFile.deleted_at.is_(None))


async def get_file(session: AsyncSession, tenant_id: str, file_id: str) -> StoredFile:
    row = await session.scalar(tenant_files(tenant_id).where(StoredFile.id == file_id))
    if row is None:
        raise not_found("file", file_id)
    return row


def storage(services: Services) -> FileStorage:
    return FileStorage(services.settings.files_path)


class FileController(Controller):
    path = "/v1/files"
    guards = [requires_scope("inference")]
    tags = ["files"]

    @post("/", status_code=200, request_max_body_size=UPLOAD_CEILING_BYTES)
    async def upload(
        self,
        data: Annotated[FileUpload, Body(media_type=RequestEncodingType.MULTI_PART)],
        request: Request[Principal, str, object],
        services: Services,
        db_session: DbSession,
    ) -> FileObject:
        """A batch input file (`purpose` `batch`, JSONL), checked whole before it is stored."""
        if data.purpose != "batch":
            raise invalid_request(f"purpose must be 'batch'; got {data.purpose!r}", param="purpose")
        filename = (data.file.filename or "").strip()
        if not filename or len(filename) > MAX_FILENAME_CHARS or "\x00" in filename:
            raise invalid_request(f"the file needs a name of 1 to {MAX_FILENAME_CHARS} characters", param="file")
        content = await data.file.read()
        limit = services.settings.max_file_bytes
        if len(content) > limit:
            raise invalid_request(f"the file is {len(content):,} bytes; at most {limit:,} are allowed", param="file")
        try:
            lines = await anyio.to_thread.run_sync(read_batch_input, content)
        except BatchInputError as error:
            raise invalid_request(f"invalid batch input file: {error}", param="file") from None
        principal = request.user
        row = StoredFile(
            id=new_id("file", separator="-"),
            tenant_id=principal.tenant_id,
            api_key_id=principal.key_id,
            purpose=data.purpose,
            filename=filename,
            bytes=len(content),
            line_count=len(lines),
            sha256=hashlib.sha256(content).hexdigest(),
            created_at=utcnow(),
        )
        store = storage(services)
        await anyio.to_thread.run_sync(store.write, row.tenant_id, row.id, content)
        try:
            db_session.add(row)
            await db_session.commit()
        except BaseException:
            store.delete(row.tenant_id, row.id)  # no row: the bytes must not stay behind
            raise
        return file_object(row)

    @get("/")
    async def list_files(
        self,
        request: Request[Principal, str, object],
        db_session: DbSession,
        purpose: FromQuery[str | None] = None,
        after: FromQuery[str | None] = None,
        limit: ListLimit = 10_000,
        order: FromQuery[Literal["asc", "desc"]] = "desc",
    ) -> FileList:
        """The caller's files, newest first (or oldest first with `order=asc`); ids are time-ordered, so `after`
        (a `last_id`) continues the listing."""
        query = tenant_files(request.user.tenant_id)
        if purpose is not None:
            query = query.where(StoredFile.purpose == purpose)
        if after is not None:
            query = query.where(StoredFile.id < after if order == "desc" else StoredFile.id > after)
        by = StoredFile.id.desc() if order == "desc" else StoredFile.id.asc()
        rows = list(await db_session.scalars(query.order_by(by).limit(limit + 1)))
        return FileList(**page_fields([file_object(r) for r in rows[:limit]], len(rows), limit))

    @get("/{file_id:str}")
    async def retrieve(
        self, file_id: FromPath[str], request: Request[Principal, str, object], db_session: DbSession
    ) -> FileObject:
        return file_object(await get_file(db_session, request.user.tenant_id, file_id))

    @get("/{file_id:str}/content", media_type="application/jsonl")
    async def content(
        self,
        file_id: FromPath[str],
        request: Request[Principal, str, object],
        services: Services,
        db_session: DbSession,
    ) -> Response[bytes]:
        row = await get_file(db_session, request.user.tenant_id, file_id)
        content = await anyio.to_thread.run_sync(storage(services).read, row.tenant_id, row.id)
        return Response(content, media_type="application/jsonl")

    @delete("/{file_id:str}", status_code=200)
    async def delete_file(
        self,
        file_id: FromPath[str],
        request: Request[Principal, str, object],
        services: Services,
        db_session: DbSession,
    ) -> FileDeleted:
        """Delete the file: its bytes now; a batch can no longer be created from it."""
        row = await get_file(db_session, request.user.tenant_id, file_id)
        row.deleted_at = utcnow()
        await db_session.commit()
        await anyio.to_thread.run_sync(storage(services).delete, row.tenant_id, row.id)
        return FileDeleted(id=row.id)
