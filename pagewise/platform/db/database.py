"""One database, two ways in: the async engine and its sessions for the routes, and `run` for the request path's
units of work.

A unit of work is a plain function of a Core `Connection`, run in one transaction: committed when it returns,
rolled back when it raises (the exception reaches the caller). Where it runs depends on the driver:

- SQLite: on one thread of its own, with the standard library's driver, so a unit costs one thread hand-off.
  Through aiosqlite every statement costs three or four (cursor, execute, fetch, close) and a commit one more,
  and on a busy machine each hand-off is a thread wake-up. SQLite serialises writers anyway, so one thread
  loses no concurrency; a writer on the async engine meanwhile is waited for (the busy timeout), off the loop.
- PostgreSQL (and an in-memory SQLite database, which a second engine would not see): on a connection of the
  async engine (`run_sync`); asyncpg is natively async, nothing to gain there.

The context (the current trace span) travels with the unit to its thread. A unit cancelled by its caller
still runs to its end (a commit cannot be taken back halfway), as it could through aiosqlite: a `queued` row
whose admission was cancelled that way has a lease nobody renews, and the orphan sweep fails it.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from pagewise.platform.db.session import create_sessionmaker, create_sync_db_engine

T = TypeVar("T")


class Database:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.sessionmaker: async_sessionmaker[AsyncSession] = create_sessionmaker(engine)
        self.sync_engine: Engine | None = None  # SQLite only: the units' engine, used on `_thread` alone
        self._thread: ThreadPoolExecutor | None = None
        if engine.dialect.name == "sqlite" and engine.url.database not in (None, "", ":memory:"):
            url = engine.url.render_as_string(hide_password=False)
            self.sync_engine = create_sync_db_engine(url, shared_across_threads=True)
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="pagewise-sqlite")

    async def run(self, work: Callable[[Connection], T]) -> T:
        """`work(connection)` in one transaction; its result once committed."""
        if self._thread is None:
            async with self.engine.begin() as connection:
                return await connection.run_sync(work)
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._thread, context.run, self._in_transaction, work)

    def _in_transaction(self, work: Callable[[Connection], T]) -> T:
        assert self.sync_engine is not None
        with self.sync_engine.begin() as connection:
            return work(connection)

    async def dispose(self) -> None:
        """Close every connection (after the units already started have run) and the async engine's pool."""
        if self._thread is not None and self.sync_engine is not None:
            await asyncio.get_running_loop().run_in_executor(self._thread, self.sync_engine.dispose)
            self._thread.shutdown(wait=True)
        await self.engine.dispose()
