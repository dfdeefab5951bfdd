"""What the database says a scope has used this month: the seed of the quota stores' monthly counters.

The monthly budgets (tokens and spend, tenant and key) are decided by counters in the quota store, but the
database is the source of truth for money: `usage_daily` is written in the transaction that settles each
request. A store that has no counter for a scope's current month — a restart of the in-process store, a Redis
flush or data loss, the first request of a month — asks the ledger before it admits anything for that scope,
and starts the counter there. A key's counter is its budget lineage's (`api_keys.budget_key_id`): the usage
of every key of its rotations.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import Connection, bindparam, func, or_, select

from pagewise.platform.db.database import Database
from pagewise.platform.db.models import ApiKey, UsageDaily
from pagewise.platform.quotas.quota_store import MonthToDate, Scope

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
        statement = _TENANT_TOTALS if scope == "tenant" else _KEY_TOTALS
        params = {"scope_id": scope_id, "first_day": first, "next_first_day": following}

        def read(connection: Connection) -> MonthToDate:
            tokens, spend = connection.execute(statement, params).one()
            return MonthToDate(tokens=int(tokens), spend=int(spend))

        return await self._database.run(read)
