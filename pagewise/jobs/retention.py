"""Retention: request bodies (input and output) go once a request finished longer ago than the retention
period; the row stays, with its tokens and cost, so usage, bills and exports never change.

Invariant: a row is purged at most once (`body_purged_at` is set with the purge), in batches of `BATCH` rows
per transaction, so a large backlog never holds one long lock and a killed job resumes where it stopped.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from pagewise.platform.db.models import UNFINISHED_STATUSES, RequestRecord

BATCH = 1000


def purge_bodies(session: Session, now: dt.datetime, retention: dt.timedelta) -> int:
    """Drop the input and output of rows finished before `now - retention`; returns how many were purged."""
    cutoff, purged = now - retention, 0
    while True:
        with session.begin():
            ids = list(session.scalars(
                select(RequestRecord.id)
                .where(
                    RequestRecord.finished_at < cutoff,
                    RequestRecord.body_purged_at.is_(None),
                    RequestRecord.status.not_in(UNFINISHED_STATUSES),
                )
                .limit(BATCH)
            ))
            if not ids:
                return purged
            session.execute(
                update(RequestRecord)
                .where(RequestRecord.id.in_(ids), RequestRecord.body_purged_at.is_(None))
                .values(input={}, output=None, body_purged_at=now)
            )
        purged += len(ids)
