"""Writes and reads `requests` rows. The database sees a request three times at most: accepted, first token,
finished — never once per token. Finishing also adds to `usage_daily` in the same transaction.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec
from sqlalchemy import Select, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from pagewise.platform.db.models import RequestRecord, UsageDaily


class FinishedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a request's final write records."""

    status: str
    output: list[dict[str, Any]]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None
    started_at: dt.datetime | None
    first_token_at: dt.datetime | None
    finished_at: dt.datetime


class RequestStore:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker

    async def create(self, record: RequestRecord) -> None:
        async with self._sessionmaker() as session:
            session.add(record)
            await session.commit()

    async def mark_running(
        self, request_id: str, started_at: dt.datetime, first_token_at: dt.datetime
    ) -> None:
        async with self._sessionmaker() as session:
            await session.execute(
                update(RequestRecord)
                .where(RequestRecord.id == request_id, RequestRecord.status == "queued")
                .values(status="running", started_at=started_at, first_token_at=first_token_at)
            )
            await session.commit()

    async def finish(self, request_id: str, tenant_id: str, model: str, result: FinishedRequest) -> None:
        """The final write and the day's usage, in one transaction."""
        async with self._sessionmaker() as session, session.begin():
            await session.execute(
                update(RequestRecord)
                .where(RequestRecord.id == request_id)
                .values(**msgspec.structs.asdict(result))
            )
            await _add_usage(session, tenant_id, model, result)

    async def fail_unfinished(self, reason: str) -> int:
        """Mark rows left queued/running by a previous process as failed; returns how many."""
        async with self._sessionmaker() as session, session.begin():
            outcome = await session.execute(
                update(RequestRecord)
                .where(RequestRecord.status.in_(("queued", "running")))
                .values(status="failed", error=reason, finished_at=dt.datetime.now(dt.UTC))
            )
        return outcome.rowcount or 0


async def _add_usage(session: AsyncSession, tenant_id: str, model: str, result: FinishedRequest) -> None:
    values = {
        "tenant_id": tenant_id,
        "day": result.finished_at.date(),
        "model": model,
        "requests": 1,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "cached_tokens": result.cached_tokens,
    }
    insert = pg_insert if session.bind.dialect.name == "postgresql" else sqlite_insert
    statement = insert(UsageDaily).values(**values)
    totals = {
        k: getattr(UsageDaily, k) + getattr(statement.excluded, k)
        for k in ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")
    }
    await session.execute(
        statement.on_conflict_do_update(index_elements=["tenant_id", "day", "model"], set_=totals)
    )


def tenant_requests(tenant_id: str) -> Select[tuple[RequestRecord]]:
    """Every query for a caller's requests starts here, so another tenant's rows are never visible."""
    return select(RequestRecord).where(RequestRecord.tenant_id == tenant_id)
