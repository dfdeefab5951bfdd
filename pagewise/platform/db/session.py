"""Database engine and session factory; the per-request session is provided by dependency injection."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, TypeAlias

from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.params import SkipValidation
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine


def create_db_engine(url: str) -> AsyncEngine:
    """An async engine; SQLite gets foreign keys on and a busy timeout so concurrent writers wait.

    Statement parameters (prompts, outputs) never appear in SQLAlchemy's errors or logs: `hide_parameters`.
    """
    if url.startswith("sqlite"):
        engine = create_async_engine(url, connect_args={"timeout": 30}, hide_parameters=True)

        @event.listens_for(engine.sync_engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.close()

        return engine
    return create_async_engine(url, pool_size=20, max_overflow=20, pool_pre_ping=True, hide_parameters=True)


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


DbSession: TypeAlias = NamedDependency[SkipValidation[AsyncSession]]
"""How a handler asks for the per-request session (dependency `db_session`)."""


async def provide_db_session(state: State) -> AsyncGenerator[AsyncSession, None]:
    """One session per HTTP request; whatever the handler did not commit is rolled back."""
    async with state.sessionmaker() as session:
        yield session
