"""Bodies of the Batch API, in OpenAI's shapes."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions"]
MAX_METADATA_KEYS = 16
MetadataKey = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
MetadataValue = Annotated[str, msgspec.Meta(max_length=512)]


class BatchCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    input_file_id: Annotated[str, msgspec.Meta(max_length=40)]
    endpoint: BatchEndpoint
    completion_window: Literal["24h"]
    metadata: Annotated[dict[MetadataKey, MetadataValue], msgspec.Meta(max_length=MAX_METADATA_KEYS)] | None = None


class RequestCounts(msgspec.Struct, kw_only=True):
    total: int
    completed: int
    failed: int


class BatchObject(msgspec.Struct, kw_only=True):
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None
    errors: None = None  # a file that fails validation is refused at creation (a 400), never a `failed` batch
    object: Literal["batch"] = "batch"


class BatchList(msgspec.Struct, kw_only=True):
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"
