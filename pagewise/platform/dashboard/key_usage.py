"""Usage per API key, from finished request rows (`usage_daily` has no key column).

Counts the same rows as the usage service's hourly buckets: every finished request in the window, whatever its
status, with the tokens it was billed. A request whose key was since deleted counts under `None`.
"""

from __future__ import annotations

import datetime as dt

import msgspec
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.db.models import UNFINISHED_STATUSES, RequestRecord


class KeyUsage(msgspec.Struct, kw_only=True):
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    input_cached_tokens: int = 0


async def usage_by_key(
    session: AsyncSession, since: dt.datetime, until: dt.datetime | None = None, *, tenant_id: str | None = None
) -> dict[str | None, KeyUsage]:
    """Key id → usage of the requests (of `tenant_id`'s, if given) that finished in [`since`, `until`)
    (`until` None: up to now)."""
    query = select(
        RequestRecord.api_key_id,
        func.count(),
        func.coalesce(func.sum(RequestRecord.prompt_tokens), 0),
        func.coalesce(func.sum(RequestRecord.completion_tokens), 0),
        func.coalesce(func.sum(RequestRecord.cached_tokens), 0),
    ).where(RequestRecord.status.not_in(UNFINISHED_STATUSES), RequestRecord.finished_at >= since)
    if until is not None:
        query = query.where(RequestRecord.finished_at < until)
    if tenant_id is not None:
        query = query.where(RequestRecord.tenant_id == tenant_id)
    rows = await session.execute(query.group_by(RequestRecord.api_key_id))
    return {
        key_id: KeyUsage(
            requests=int(n), input_tokens=int(prompt), output_tokens=int(completion), input_cached_tokens=int(cached)
        )
        for key_id, n, prompt, completion, cached in rows.all()
    }
