"""Bodies of the Files API, in OpenAI's shapes."""

from __future__ import annotations

from typing import Literal

import msgspec

from pagewise.platform.db.models import StoredFile, as_utc

Purpose = Literal["batch"]


class FileObject(msgspec.Struct, kw_only=True):
    id: str
    bytes: int
    created_at: int  # Unix seconds
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None
    object: Literal["file"] = "file"


class FileList(msgspec.Struct, kw_only=True):
    """A page, newest first; pass `last_id` as `after` for the next page while `has_more`."""

    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"


class FileDeleted(msgspec.Struct, kw_only=True):
    id: str
    deleted: bool = True
    object: Literal["file"] = "file"


def file_object(row: StoredFile) -> FileObject:
    return FileObject(
        id=row.id,
        bytes=row.bytes,
        created_at=int(as_utc(row.created_at).timestamp()),
        filename=row.filename,
        purpose=row.purpose,
    )
