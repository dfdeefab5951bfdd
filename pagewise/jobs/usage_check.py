"""The roll-up check: `usage_daily` (written in each request's settlement transaction, the one source of truth)
against the sum of that day's finished request rows. The jobs never write usage; they report any difference.

Invariant checked: for every (tenant, model, key) of a UTC day, `usage_daily`'s tokens and cost equal the sums
over the rows that finished that day. Request counts are not compared: a row failed by a sweep is not counted in
`usage_daily` (it billed nothing). (Days before revision 0004 hold usage not attributed to a
key, `""`, and do not compare; the scheduled checks look at today and yesterday only.)
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from pagewise.platform.db.models import UNFINISHED_STATUSES, RequestRecord, UsageDaily

_Key = tuple[str, str, str]  # tenant, model, key
_Totals = tuple[int, int, int, int]  # prompt, completion, cached, cost
_ZERO: _Totals = (0, 0, 0, 0)


def _from_rows(session: Session, day: dt.date) -> dict[_Key, _Totals]:
    start = dt.datetime.combine(day, dt.time(), dt.UTC)
    key = func.coalesce(RequestRecord.api_key_id, "")
    query = (
        select(
            RequestRecord.tenant_id,
            RequestRecord.model,
            key,
            func.sum(RequestRecord.prompt_tokens),
            func.sum(RequestRecord.completion_tokens),
            func.sum(RequestRecord.cached_tokens),
            func.sum(RequestRecord.cost_micros),
        )
        .where(
            RequestRecord.finished_at >= start,
            RequestRecord.finished_at < start + dt.timedelta(days=1),
            RequestRecord.status.not_in(UNFINISHED_STATUSES),
        )
        .group_by(RequestRecord.tenant_id, RequestRecord.model, key)
    )
    return {(t, m, k): (int(p), int(c), int(x), int(s)) for t, m, k, p, c, x, s in session.execute(query)}


def _recorded(session: Session, day: dt.date) -> dict[_Key, _Totals]:
    """`usage_daily`'s totals per (tenant, model, key): a key's batches and its interactive usage summed."""
    totals: dict[_Key, _Totals] = {}
    for u in session.scalars(select(UsageDaily).where(UsageDaily.day == day)):
        p, c, x, s = totals.get((u.tenant_id, u.model, u.api_key_id), _ZERO)
        totals[(u.tenant_id, u.model, u.api_key_id)] = (
            p + u.prompt_tokens, c + u.completion_tokens, x + u.cached_tokens, s + u.cost_micros
        )
    return totals


def check_day(session: Session, day: dt.date) -> list[str]:
    """The differences between `usage_daily` and the request rows of `day`, one readable line each; `[]` when
    they agree."""
    rows, recorded = _from_rows(session, day), _recorded(session, day)
    return [
        f"{day} tenant={t} model={m} key={k or '-'}: usage_daily {recorded.get((t, m, k), _ZERO)} "
        f"!= rows {rows.get((t, m, k), _ZERO)} (prompt, completion, cached, cost)"
        for t, m, k in sorted(set(rows) | set(recorded))
        if rows.get((t, m, k), _ZERO) != recorded.get((t, m, k), _ZERO)
    ]
