"""The jobs' synchronous database access: the platform's URL with a synchronous driver (`db/session.py` builds
the engine, configured as the platform's own).

Invariant: one engine per process and URL, created on first use — after a prefork worker forked its children,
so no connection is ever shared across processes.
"""

from __future__ import annotations

import functools

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from pagewise.platform.db.session import create_sync_db_engine


@functools.cache
def _engine(url: str) -> Engine:
    return create_sync_db_engine(url)


def session_factory(url: str) -> sessionmaker[Session]:
    """Sessions on the database at the platform's `url` (an async driver's URL)."""
    return sessionmaker(_engine(url), expire_on_commit=False)
