"""Database engine and session factory; the per-request session is provided by dependency injection.

Anything printed about a database names it by `redacted_url`: its password never reaches a terminal or a log.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncGenerator
from contextlib import closing
from pathlib import Path
from typing import Any, TypeAlias

from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.params import SkipValidation
from sqlalchemy import Engine, TextClause, create_engine, event, make_url, text
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session

CONNECT_TIMEOUT_S = 10.0


class DatabaseUnreachableError(ConnectionError):
    """The database cannot be opened. The message is one line naming the URL (password hidden) and the cause."""


SQLITE_BUSY_TIMEOUT_S = 30  # how long a SQLite writer waits for another to finish


def set_sqlite_pragmas(engine: Engine) -> None:
    """Every connection `engine` opens gets foreign keys on and the write-ahead log (readers never wait for the
    writer); `synchronous` stays at its default, FULL, so a commit that returned survives a power loss."""

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.close()


_SQLITE_WRITE_LOCK = text("UPDATE tenants SET id = id WHERE 0")


def sqlite_write_lock(session: Session | AsyncSession) -> TextClause | None:
    """What a check-then-write (the last-admin rule, an export's next revision) executes first on SQLite: a write
    that changes nothing but opens the database's one write transaction, so a concurrent check waits (up to the
    busy timeout) until this one commits, then reads what it wrote. None elsewhere: on PostgreSQL the check locks
    the rows it reads (`FOR UPDATE`), which SQLite ignores."""
    return _SQLITE_WRITE_LOCK if session.get_bind().dialect.name == "sqlite" else None


_SYNC_DRIVERS = {"postgresql+asyncpg": "postgresql+psycopg", "sqlite+aiosqlite": "sqlite"}


def sync_url(url: str) -> str:
    """The platform's database URL with a synchronous driver: `postgresql+asyncpg://…` → `postgresql+psycopg://…`,
    `sqlite+aiosqlite://…` → `sqlite://…` (a URL that has one already is returned as it is)."""
    driver, rest = url.split("://", 1)
    if driver in _SYNC_DRIVERS.values():
        return url
    if driver not in _SYNC_DRIVERS:
        raise ValueError(f"no synchronous driver for {driver!r}; expected one of {', '.join(_SYNC_DRIVERS)}")
    return f"{_SYNC_DRIVERS[driver]}://{rest}"


def create_sync_db_engine(url: str, *, shared_across_threads: bool = False) -> Engine:
    """A synchronous engine on the database at `url` (see `sync_url`), configured as `create_db_engine`'s:
    SQLite with the same pragmas and busy timeout (`shared_across_threads`: one connection may be used from
    another thread than the one that opened it), PostgreSQL with a pre-pinged pool; parameters hidden."""
    url = sync_url(url)
    if url.startswith("sqlite"):
        connect: dict[str, Any] = {"timeout": SQLITE_BUSY_TIMEOUT_S}
        if shared_across_threads:
            connect["check_same_thread"] = False
        engine = create_engine(url, connect_args=connect, hide_parameters=True)
        set_sqlite_pragmas(engine)
        return engine
    return create_engine(url, pool_pre_ping=True, hide_parameters=True)


def create_db_engine(url: str) -> AsyncEngine:
    """An async engine; SQLite gets foreign keys on and a busy timeout so concurrent writers wait.

    Statement parameters (prompts, outputs) never appear in SQLAlchemy's errors or logs: `hide_parameters`.
    """
    if url.startswith("sqlite"):
        engine = create_async_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S}, hide_parameters=True)
        set_sqlite_pragmas(engine.sync_engine)
        return engine
    return create_async_engine(url, pool_size=20, max_overflow=20, pool_pre_ping=True, hide_parameters=True)


def redacted_url(url: str) -> str:
    """`url` with its password shown as `***`; a URL SQLAlchemy cannot parse is reduced to its scheme."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return f"{url.split('://', 1)[0]}://…"


async def check_database(url: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Open one connection and run `SELECT 1`, or raise `DatabaseUnreachableError`. Changes nothing, except that
    SQLite creates an empty file when its directory exists (as the first migration would)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        _check_sqlite(url, parsed.database or "")
        return
    engine = create_db_engine(url)
    try:
        async with asyncio.timeout(timeout_s), engine.connect() as connection:
            await connection.execute(text("SELECT 1"))
    except TimeoutError:
        raise _unreachable(url, f"no answer within {timeout_s:g} s") from None
    except (DBAPIError, OSError) as error:
        cause = error.orig if isinstance(error, DBAPIError) else error
        raise _unreachable(url, str(cause) or type(cause).__name__) from None
    finally:
        await engine.dispose()


def _check_sqlite(url: str, database: str) -> None:
    """With the standard library's driver: a failed aiosqlite connect leaves a thread that prints a traceback."""
    directory = Path(database).absolute().parent
    if database not in ("", ":memory:") and not directory.is_dir():
        raise _unreachable(url, f"the directory {directory} does not exist")
    try:
        with closing(sqlite3.connect(database or ":memory:")) as connection:
            connection.execute("SELECT 1")
    except sqlite3.Error as error:
        raise _unreachable(url, str(error)) from None


def _unreachable(url: str, cause: str) -> DatabaseUnreachableError:
    return DatabaseUnreachableError(f"cannot open the database {redacted_url(url)}: {' '.join(cause.split())}")


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


DbSession: TypeAlias = NamedDependency[SkipValidation[AsyncSession]]
"""How a handler asks for the per-request session (dependency `db_session`)."""


async def provide_db_session(state: State) -> AsyncGenerator[AsyncSession, None]:
    """One session per HTTP request; whatever the handler did not commit is rolled back."""
    async with state.sessionmaker() as session:
        yield session
