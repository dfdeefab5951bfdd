"""The jobs' synchronous database access: the platform's URL with a synchronous driver.

Invariant: one engine per process and URL, created on first use — after a prefork worker forked its children,
so no connection is ever shared across processes.
"""

from __future__ import annotations

import functools

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

_SYNC_DRIVERS = {"postgresql+asyncpg": "postgresql+psycopg", "sqlite+aiosqlite": "sqlite"}


def sync_url(url: str) -> str:
    """`postgresql+asyncpg://…` → `postgresql+psycopg://…`, `sqlite+aiosqlite://…` → `sqlite://…`."""
    driver, rest = url.split("://", 1)
    if driver not in _SYNC_DRIVERS:
        raise ValueError(f"no synchronous driver for {driver!r}; expected one of {', '.join(_SYNC_DRIVERS)}")
    return f"{_SYNC_DRIVERS[driver]}://{rest}"


@functools.cache
def _engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30}, hide_parameters=True)

        @event.listens_for(engine, "connect")
        def _foreign_keys(dbapi_connection, _record) -> None:  # noqa: ANN001 - DB-API objects
            dbapi_connection.execute("PRAGMA foreign_keys=ON")

        return engine
    return create_engine(url, pool_pre_ping=True, hide_parameters=True)


def session_factory(url: str) -> sessionmaker[Session]:
    """Sessions on the database at the platform's `url` (an async driver's URL)."""
    return sessionmaker(_engine(sync_url(url)), expire_on_commit=False)
