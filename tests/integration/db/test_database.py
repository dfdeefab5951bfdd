"""`Database.run`: a unit of work is one transaction, on SQLite on a thread of its own, on PostgreSQL on the loop."""

from __future__ import annotations

import contextvars
import secrets
import threading

import pytest
from sqlalchemy import Connection, insert, select, text

from pagewise.platform.db.database import Database
from pagewise.platform.db.models import Tenant
from pagewise.platform.db.session import create_db_engine

pytestmark = pytest.mark.anyio

_CALLER = contextvars.ContextVar[str]("caller")


def _add_tenant(name: str, connection: Connection) -> None:
    connection.execute(insert(Tenant.__table__), {"id": f"tnt_{secrets.token_hex(8)}", "name": name})


async def _tenant_names(database: Database, *names: str) -> set[str]:
    async with database.sessionmaker() as session:
        return set((await session.scalars(select(Tenant.name).where(Tenant.name.in_(names)))).all())


async def test_a_unit_commits_when_it_returns_and_rolls_back_when_it_raises(database: Database) -> None:
    kept, dropped = f"kept-{secrets.token_hex(4)}", f"dropped-{secrets.token_hex(4)}"
    await database.run(lambda connection: _add_tenant(kept, connection))

    def add_then_fail(connection: Connection) -> None:
        _add_tenant(dropped, connection)
        raise ValueError("changed my mind")

    with pytest.raises(ValueError, match="changed my mind"):
        await database.run(add_then_fail)
    assert await _tenant_names(database, kept, dropped) == {kept}


async def test_units_run_where_the_driver_is_cheapest(database: Database) -> None:
    """SQLite: every unit on the one `pagewise-sqlite` thread; PostgreSQL: on the caller's thread (asyncpg)."""
    names = {await database.run(lambda _: threading.current_thread().name) for _ in range(5)}
    if database.engine.dialect.name == "sqlite":
        assert database.sync_engine is not None
        assert len(names) == 1 and names.pop().startswith("pagewise-sqlite")
    else:
        assert database.sync_engine is None
        assert names == {threading.current_thread().name}


async def test_the_callers_context_travels_with_the_unit(database: Database) -> None:
    """What the current trace span rides on: the caller's context variables are visible inside the unit."""
    _CALLER.set("request-42")
    assert await database.run(lambda _: _CALLER.get(None)) == "request-42"


async def test_an_in_memory_sqlite_database_stays_on_the_async_engine() -> None:
    database = Database(create_db_engine("sqlite+aiosqlite://"))
    try:
        assert database.sync_engine is None  # a second engine would open a different, empty database
        assert await database.run(lambda connection: connection.execute(text("SELECT 41 + 1")).scalar()) == 42
    finally:
        await database.dispose()
