"""What the database says a scope has used this month: the seed of the quota stores' monthly counters.

The monthly budgets (tokens and spend, tenant and key) are decided by counters in the quota store, but the
database is the source of truth for money: `usage_daily` is written in the transaction that settles each
request. A store that has no counter for a scope's current month — a restart of the in-process store, a Redis
flush or data loss, the first request of a month — asks the ledger before it admits anything for that scope,
and starts the counter there. A key's counter is its budget lineage's (`api_keys.budget_key_id`): the usage
of every key of its rotations.

The month also counts what is admitted but not billed yet: every unfinished request of the scope queued this
month, at what admission reserved for it (`requests.reserved_tokens` / `reserved_micros`). A store that lost
its data lost those requests' reservations too; their usage reaches `usage_daily` when they settle, and their
reconcile then finds no reservation to adjust, so the counter keeps the reserved amount — an upper bound of
what they bill. So a rebuilt month never admits more than the budget, at the cost of holding back, until the
next rebuild, what those requests reserved beyond what they billed.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import Connection, bindparam, func, or_, select

from pagewise.platform.db.database import Database
from pagewise.platform.db.models import ApiKey, RequestRecord, UsageDaily
from pagewise.platform.quotas.quota_store import MonthToDate, Scope
from pagewise.platform.requests.store import UNFINISHED_STATUSES

_USAGE = UsageDaily.__table__
_KEYS = ApiKey.__table__
_TOTALS = select(
    func.coalesce(func.sum(_USAGE.c.prompt_tokens + _USAGE.c.completion_tokens), 0),
    func.coalesce(func.sum(_USAGE.c.cost_micros), 0),
).where(_USAGE.c.day >= bindparam("first_day"), _USAGE.c.day < bindparam("next_first_day"))
_TENANT_TOTALS = _TOTALS.where(_USAGE.c.tenant_id == bindparam("scope_id"))
_SUCCESSORS = select(_KEYS.c.id).where(_KEYS.c.budget_key_id == bindparam("scope_id"))
_KEY_TOTALS = _TOTALS.where(
    or_(_USAGE.c.api_key_id == bindparam("scope_id"), _USAGE.c.api_key_id.in_(_SUCCESSORS))
)
_ROWS = RequestRecord.__table__
_IN_FLIGHT = select(
    func.coalesce(func.sum(_ROWS.c.reserved_tokens), 0), func.coalesce(func.sum(_ROWS.c.reserved_micros), 0)
).where(
    _ROWS.c.status.in_([s.value for s in UNFINISHED_STATUSES]),
    _ROWS.c.queued_at >= bindparam("first_moment"),
    _ROWS.c.queued_at < bindparam("next_first_moment"),
)
_TENANT_IN_FLIGHT = _IN_FLIGHT.where(_ROWS.c.tenant_id == bindparam("scope_id"))
_KEY_IN_FLIGHT = _IN_FLIGHT.where(
    or_(_ROWS.c.api_key_id == bindparam("scope_id"), _ROWS.c.api_key_id.in_(_SUCCESSORS))
)


def month_days(month: str) -> tuple[dt.date, dt.date]:
    """The first day of `month` (`YYYYMM`, a quota window's name) and of the month after."""
    first = dt.date(int(month[:4]), int(month[4:]), 1)
    return first, (first.replace(day=28) + dt.timedelta(days=4)).replace(day=1)


class DatabaseLedger:
    """`MonthLedger` over the platform's database."""

    def __init__(self, database: Database) -> None:
        self._database = database

    async def month_to_date(self, scope: Scope, scope_id: str, month: str) -> MonthToDate:
        first, following = month_days(month)
        billed, in_flight = (_TENANT_TOTALS, _TENANT_IN_FLIGHT) if scope == "tenant" else (_KEY_TOTALS, _KEY_IN_FLIGHT)
        params = {
            "scope_id": scope_id,
            "first_day": first,
            "next_first_day": following,
            "first_moment": dt.datetime.combine(first, dt.time(), dt.UTC),
            "next_first_moment": dt.datetime.combine(following, dt.time(), dt.UTC),
        }

        def read(connection: Connection) -> MonthToDate:
            tokens, spend = connection.execute(billed, params).one()
            reserved_tokens, reserved_spend = connection.execute(in_flight, params).one()
            return MonthToDate(tokens=int(tokens) + int(reserved_tokens), spend=int(spend) + int(reserved_spend))

        return await self._database.run(read)
