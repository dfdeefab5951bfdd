"""Bodies of the asynchronous requests API and of admin request listings."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

import msgspec

from pagewise.platform.db.models import RequestRecord
from pagewise.platform.inference.schemas import PromptTokensDetails, Usage
from pagewise.platform.pages import page_fields
from pagewise.platform.requests.store import row_error


class RequestError(msgspec.Struct, frozen=True):
    """Why a request failed: our error code (the same `code` its HTTP error carried) and a public message."""

    code: str
    message: str


class RequestOut(msgspec.Struct, kw_only=True):
    id: str
    endpoint: str
    model: str
    status: str
    input: dict[str, Any]
    params: dict[str, Any]
    output: list[Any] | None
    finish_reason: str | None
    usage: Usage
    error: RequestError | None  # on a failed request only
    queued_at: dt.datetime
    started_at: dt.datetime | None
    first_token_at: dt.datetime | None
    finished_at: dt.datetime | None
    tenant_id: str
    api_key_id: str | None  # the key that made the request; `None` once that key is deleted
    trace_id: str | None = None  # its OpenTelemetry trace (32 hex digits) when tracing was on
    object: Literal["request"] = "request"


class RequestList(msgspec.Struct, kw_only=True):
    """A page, newest first (by `queued_at`, then `id`); pass `last_id` as `after` for the next page while
    `has_more`.
    """

    data: list[RequestOut]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"


def request_out(row: RequestRecord) -> RequestOut:
    usage = Usage(
        row.prompt_tokens,
        row.completion_tokens,
        row.prompt_tokens + row.completion_tokens,
        PromptTokensDetails(row.cached_tokens),
    )
    return RequestOut(
        id=row.id,
        endpoint=row.endpoint,
        model=row.model,
        status=row.status,
        input=row.input,
        params=row.params,
        output=row.output,
        finish_reason=row.finish_reason,
        usage=usage,
        error=None if (error := row_error(row)) is None else RequestError(error.code.value, error.message),
        queued_at=row.queued_at,
        started_at=row.started_at,
        first_token_at=row.first_token_at,
        finished_at=row.finished_at,
        tenant_id=row.tenant_id,
        api_key_id=row.api_key_id,
        trace_id=row.trace_id,
    )


def request_page(rows: list[RequestRecord], limit: int) -> RequestList:
    """`rows` holds up to `limit + 1` rows; the extra one only tells whether there is more."""
    return RequestList(**page_fields([request_out(r) for r in rows[:limit]], len(rows), limit))
