"""Writes and reads `requests` rows. The database sees a request three times at most: accepted, first token,
finished — never once per token (lease renewals batch many rows into one statement).

Invariant: a row reaches a terminal status exactly once. Every final write (`finish`, `fail_orphans`,
`fail_unfinished`) is guarded on an unfinished status, and `finish` adds to `usage_daily` only when its own
guarded write won, in the same transaction — so usage counts each request once, whoever finished it.
The cost is computed there too, from the price in effect at `finished_at`, and the row and its day's usage get
the same integer; a row a sweep failed billed no tokens and costs nothing.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Sequence
from functools import partial
from typing import Any

import msgspec
from sqlalchemy import ColumnElement, Connection, Executable, Select, bindparam, insert, select, tuple_, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.billing.prices import first_price_in_effect, request_cost
from pagewise.platform.db.database import Database
from pagewise.platform.db.faults import is_database_fault
from pagewise.platform.db.models import UNFINISHED_STATUSES, RequestRecord, UsageDaily, as_utc
from pagewise.platform.errors import invalid_request
from pagewise.serving.ledgers import Billed, FinishedRequest
from pagewise.serving.protocol import ErrorCode, ErrorInfo, RequestStatus

ORPHANED = ErrorInfo(ErrorCode.WORKER_LOST, "the process serving it stopped before it finished")
INTERRUPTED = ErrorInfo(ErrorCode.WORKER_LOST, "the server stopped before it finished")


_ROWS = RequestRecord.__table__
_UNFINISHED = [status.value for status in UNFINISHED_STATUSES]
# The request path's statements, built once with bind parameters (the SET clause of an update comes from the
# keys of the parameters it runs with): a reused statement keeps SQLAlchemy from rebuilding its clauses and
# cache key per request, and Core statements skip the ORM's flush machinery, which costs more than the statement.
_INSERT = insert(_ROWS)
_START = update(_ROWS).where(_ROWS.c.id == bindparam("request_id"), _ROWS.c.status == RequestStatus.QUEUED.value)
_FINISH = (
    update(_ROWS)
    .where(_ROWS.c.id == bindparam("request_id"), _ROWS.c.status.in_(_UNFINISHED))
    .returning(_ROWS.c.api_key_id, _ROWS.c.batch_id)
)
# a batch line's cost, once the final write that won knows the row is one (only batch rows pay this statement)
_BATCH_COST = update(_ROWS).where(_ROWS.c.id == bindparam("request_id")).values(cost_micros=bindparam("cost"))


class RequestStore:
    def __init__(self, database: Database) -> None:
        self._database = database
        self._sessionmaker = database.sessionmaker

    async def create(self, record: RequestRecord) -> None:
        """Insert `record` (a new, unsaved row; its unset columns take their defaults), committed on return."""
        values = {column.key: getattr(record, column.key) for column in _ROWS.c if column.key in record.__dict__}
        await self._database.run(partial(_execute, _INSERT, values))

    async def mark_running(self, request_id: str, started_at: dt.datetime, first_token_at: dt.datetime) -> None:
        values = {"status": RequestStatus.RUNNING.value, "started_at": started_at, "first_token_at": first_token_at}
        await self._database.run(partial(_execute, _START, {"request_id": request_id, **values}))

    async def finish(
        self,
        request_id: str,
        tenant_id: str,
        model: str,
        result: FinishedRequest,
        *,
        price_models: tuple[str, ...] | None = None,
    ) -> Billed | None:
        """The final write, its cost and the day's usage (under `model`), in one transaction, priced by the first of
        `price_models` (default: `model`) with a price in effect. Returns what it billed when this call finished
        the row; `None` when it was already terminal (finished before, or failed by a sweep) — then nothing
        changes.
        """
        prices = price_models or (model,)
        return await self._database.run(partial(_finish, request_id, tenant_id, model, prices, result))

    async def final_state(self, request_id: str) -> FinishedRequest | None:
        """What the row's final write recorded, or `None` while it is unfinished (or missing)."""
        async with self._sessionmaker() as session:
            row = await session.get(RequestRecord, request_id)
        if row is None or row.status in UNFINISHED_STATUSES:
            return None
        return FinishedRequest(
            status=row.status,
            output=list(row.output or []),
            finish_reason=row.finish_reason,
            prompt_tokens=row.prompt_tokens,
            completion_tokens=row.completion_tokens,
            cached_tokens=row.cached_tokens,
            error=row_error(row),
            started_at=None if row.started_at is None else as_utc(row.started_at),
            first_token_at=None if row.first_token_at is None else as_utc(row.first_token_at),
            finished_at=as_utc(row.finished_at or dt.datetime.now(dt.UTC)),
        )

    async def renew_leases(self, request_ids: Collection[str], until: dt.datetime) -> None:
        """Set the lease of the unfinished rows among `request_ids` to `until`, in one statement; finished
        rows keep theirs.
        """
        if not request_ids:
            return
        async with self._sessionmaker() as session, session.begin():
            await session.execute(
                update(RequestRecord)
                .where(RequestRecord.id.in_(request_ids), RequestRecord.status.in_(UNFINISHED_STATUSES))
                .values(lease_expires_at=until.astimezone(dt.UTC))
            )

    def is_unreachable(self, error: BaseException) -> bool:
        return is_database_fault(error)

    async def fail_orphans(self, now: dt.datetime) -> int:
        """Fail the unfinished rows whose lease expired before `now` (their process stopped); returns how
        many. Rows without a lease (an embedded server's, a NULL never compares) are left to `fail_unfinished`.
        """
        now = now.astimezone(dt.UTC)
        return await self._fail(ORPHANED, now, RequestRecord.lease_expires_at < now)

    async def fail_unfinished(self) -> int:
        """Mark rows left queued/running by a previous process as failed (`INTERRUPTED`); returns how many."""
        return await self._fail(INTERRUPTED, dt.datetime.now(dt.UTC))

    async def _fail(self, error: ErrorInfo, now: dt.datetime, *conditions: ColumnElement[bool]) -> int:
        async with self._sessionmaker() as session, session.begin():
            outcome = await session.execute(
                update(RequestRecord)
                .where(RequestRecord.status.in_(UNFINISHED_STATUSES), *conditions)
                .values(status=RequestStatus.FAILED, error_code=error.code, error=error.message, finished_at=now)
            )
        return outcome.rowcount or 0


_USAGE_TOTALS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "cost_micros")
_USAGE = UsageDaily.__table__


def _usage_upsert(insert_for_dialect: Any) -> Any:
    """Add a settled request's totals to its `usage_daily` row, creating the row at its first request."""
    statement = insert_for_dialect(_USAGE)
    totals = {k: _USAGE.c[k] + statement.excluded[k] for k in _USAGE_TOTALS}
    keys = ["tenant_id", "day", "model", "api_key_id", "batch_id"]
    return statement.on_conflict_do_update(index_elements=keys, set_=totals)


_USAGE_UPSERT = {"postgresql": _usage_upsert(pg_insert), "sqlite": _usage_upsert(sqlite_insert)}


def _execute(statement: Executable, values: dict[str, Any], connection: Connection) -> None:
    connection.execute(statement, values)


def _finish(
    request_id: str,
    tenant_id: str,
    model: str,
    price_models: tuple[str, ...],
    result: FinishedRequest,
    connection: Connection,
) -> Billed | None:
    """`RequestStore.finish`'s unit of work. The usage row is the tenant's, model's and (as the row names it)
    key's, on the day of `finished_at`."""
    price = first_price_in_effect(connection, price_models, result.finished_at)
    tokens = (result.prompt_tokens, result.cached_tokens, result.completion_tokens)
    cost = request_cost(price, *tokens)
    values = msgspec.structs.asdict(result)
    error = result.error
    values.update(
        request_id=request_id,
        cost_micros=cost,
        price_id=None if price is None else price.id,
        error_code=None if error is None else error.code,
        error=None if error is None else error.message,
    )
    won = connection.execute(_FINISH, values).first()
    if won is None:
        return None
    if won.batch_id is not None:
        cost = request_cost(price, *tokens, batch=True)
        connection.execute(_BATCH_COST, {"request_id": request_id, "cost": cost})
    usage = {
        "tenant_id": tenant_id,
        "day": result.finished_at.astimezone(dt.UTC).date(),
        "model": model,
        "api_key_id": won.api_key_id or "",
        "batch_id": won.batch_id or "",
        "requests": 1,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "cached_tokens": result.cached_tokens,
        "cost_micros": cost,
    }
    connection.execute(_USAGE_UPSERT[connection.dialect.name], usage)
    return Billed(cost)


def row_error(row: RequestRecord) -> ErrorInfo | None:
    """A row's error as data: our code and the public message (the cause of a failure is in the log)."""
    if row.error_code is None:
        return None
    return ErrorInfo(ErrorCode(row.error_code), row.error or "")


def tenant_requests(tenant_id: str) -> Select[tuple[RequestRecord]]:
    """Every query for a caller's requests starts here, so another tenant's rows are never visible."""
    return select(RequestRecord).where(RequestRecord.tenant_id == tenant_id)


async def newest_first(
    session: AsyncSession,
    scope: Select[tuple[RequestRecord]],
    *,
    after: str | None,
    limit: int,
    filters: Sequence[ColumnElement[bool]] = (),
) -> list[RequestRecord]:
    """Up to `limit + 1` rows of `scope` matching `filters`, newest first: `queued_at DESC, id DESC`, a total
    order, so a keyset cursor on it never skips or repeats a row. `after` names the row to start after; it is
    looked up in `scope` alone (a row that has since left `filters` still marks its place), and an id outside
    `scope` is a 400 naming `after` rather than an empty page.
    """
    query = scope.where(*filters)
    if after is not None:
        cursor = scope.with_only_columns(RequestRecord.queued_at).where(RequestRecord.id == after)
        queued_at = await session.scalar(cursor)
        if queued_at is None:
            raise invalid_request(f"No request found with id '{after}' to list after", param="after")
        query = query.where(tuple_(RequestRecord.queued_at, RequestRecord.id) < tuple_(queued_at, after))
    query = query.order_by(RequestRecord.queued_at.desc(), RequestRecord.id.desc()).limit(limit + 1)
    return list((await session.scalars(query)).all())
