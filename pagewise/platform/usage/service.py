"""Usage buckets for `/v1/usage` (one tenant) and `/admin/usage` (any grouping).

Daily buckets read `usage_daily` (kept in step with finished requests); hourly buckets aggregate finished
request rows. Every bucket in the range is returned, empty ones included, as OpenAI's Usage API does.
`cost_micros` is spend in integer micro-dollars, the sum of the requests' settled costs. Grouped by
`api_key_id`, usage not attributed to a key (recorded before keys were tracked) has `api_key_id` null; grouped
by `batch_id`, interactive usage has `batch_id` null.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec
from litestar.params import QueryParameter
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.db.models import UNFINISHED_STATUSES, RequestRecord, UsageDaily, as_utc
from pagewise.platform.errors import invalid_request
from pagewise.serving.protocol import RequestStatus

MAX_UNIX_TIME = 253_402_300_799  # 9999-12-31T23:59:59Z, the last second a datetime holds
UnixTime = Annotated[int | None, QueryParameter(ge=0, le=MAX_UNIX_TIME, description="Unix seconds")]
BucketWidth = Literal["1d", "1h"]
GroupField = Literal["tenant_id", "model", "api_key_id", "batch_id"]
# a tenant sees only its own rows: grouping by tenant means nothing
TenantGroupField = Literal["model", "api_key_id", "batch_id"]
_WIDTH = {"1d": dt.timedelta(days=1), "1h": dt.timedelta(hours=1)}
_FINISHED = tuple(s.value for s in RequestStatus if s not in UNFINISHED_STATUSES)


class UsageResult(msgspec.Struct, kw_only=True):
    input_tokens: int = 0
    output_tokens: int = 0
    input_cached_tokens: int = 0
    num_model_requests: int = 0
    cost_micros: int = 0
    model: str | None = None
    tenant_id: str | None = None
    api_key_id: str | None = None
    batch_id: str | None = None
    object: Literal["organization.usage.completions.result"] = "organization.usage.completions.result"


class UsageBucket(msgspec.Struct, kw_only=True):
    start_time: int
    end_time: int
    results: list[UsageResult]
    object: Literal["bucket"] = "bucket"


class UsagePage(msgspec.Struct, kw_only=True):
    data: list[UsageBucket]
    has_more: bool = False
    next_page: str | None = None
    object: Literal["page"] = "page"


class _Row(msgspec.Struct):
    start: dt.datetime
    tenant_id: str
    model: str
    api_key_id: str | None
    batch_id: str | None
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cost_micros: int


async def usage_page(
    session: AsyncSession,
    *,
    start_time: int,
    end_time: int | None,
    width: BucketWidth,
    group_by: Sequence[GroupField],
    tenant_id: str | None,
) -> UsagePage:
    step = _WIDTH[width]
    start = _floor(dt.datetime.fromtimestamp(start_time, dt.UTC), width)
    end = dt.datetime.fromtimestamp(end_time, dt.UTC) if end_time is not None else dt.datetime.now(dt.UTC)
    if end <= start:
        raise invalid_request("end_time must be after start_time", param="end_time")
    if (end - start) / step > 31 * 24:
        raise invalid_request("the range holds too many buckets; narrow it or use a wider bucket_width")
    rows = await (_daily_rows if width == "1d" else _hourly_rows)(session, start, end, tenant_id)
    grouped: dict[int, dict[tuple, UsageResult]] = defaultdict(dict)
    for row in rows:
        key = tuple(getattr(row, g) for g in group_by)
        bucket = grouped[int(row.start.timestamp())]
        result = bucket.setdefault(key, UsageResult(**dict(zip(group_by, key, strict=True))))
        result.num_model_requests += row.requests
        result.input_tokens += row.prompt_tokens
        result.output_tokens += row.completion_tokens
        result.input_cached_tokens += row.cached_tokens
        result.cost_micros += row.cost_micros
    step_s = int(step.total_seconds())  # bucket bounds in seconds: the last may end past the datetime range
    return UsagePage(
        data=[
            UsageBucket(start_time=t, end_time=t + step_s, results=list(grouped.get(t, {}).values()))
            for t in range(int(start.timestamp()), math.ceil(end.timestamp()), step_s)
        ]
    )


def _floor(moment: dt.datetime, width: BucketWidth) -> dt.datetime:
    moment = moment.replace(minute=0, second=0, microsecond=0)
    return moment.replace(hour=0) if width == "1d" else moment


async def _daily_rows(
    session: AsyncSession, start: dt.datetime, end: dt.datetime, tenant_id: str | None
) -> list[_Row]:
    query = select(UsageDaily).where(UsageDaily.day >= start.date(), UsageDaily.day <= end.date())
    if tenant_id is not None:
        query = query.where(UsageDaily.tenant_id == tenant_id)
    return [
        _Row(
            dt.datetime.combine(u.day, dt.time(), dt.UTC),
            u.tenant_id,
            u.model,
            u.api_key_id or None,
            u.batch_id or None,
            u.requests,
            u.prompt_tokens,
            u.completion_tokens,
            u.cached_tokens,
            u.cost_micros,
        )
        for u in (await session.scalars(query)).all()
        if dt.datetime.combine(u.day, dt.time(), dt.UTC) < end
    ]


async def _hourly_rows(
    session: AsyncSession, start: dt.datetime, end: dt.datetime, tenant_id: str | None
) -> list[_Row]:
    columns = (
        RequestRecord.finished_at,
        RequestRecord.tenant_id,
        RequestRecord.model,
        RequestRecord.api_key_id,
        RequestRecord.batch_id,
        RequestRecord.prompt_tokens,
        RequestRecord.completion_tokens,
        RequestRecord.cached_tokens,
        RequestRecord.cost_micros,
    )
    query = select(*columns).where(
        RequestRecord.status.in_(_FINISHED),
        RequestRecord.finished_at >= start,
        RequestRecord.finished_at < end,
    )
    if tenant_id is not None:
        query = query.where(RequestRecord.tenant_id == tenant_id)
    return [
        _Row(_floor(as_utc(finished), "1h"), tenant, model, key, batch, 1, prompt, completion, cached, cost)
        for finished, tenant, model, key, batch, prompt, completion, cached, cost in await session.execute(query)
    ]
