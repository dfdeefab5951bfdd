"""An empty, migrated database of each kind per test: for rules about *all* keys (the last admin, the
bootstrap) that the shared session database, full of other tests' admins, cannot show."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from pagewise.platform.db.database import Database
from pagewise.platform.db.migrate import upgrade_head
from pagewise.platform.db.session import create_db_engine


@pytest.fixture(params=["sqlite", "postgres"])
def empty_database_url(request: pytest.FixtureRequest, fresh_database: Callable[[str], str]) -> str:
    url = fresh_database(request.param)
    upgrade_head(url)
    return url


@pytest.fixture
async def empty_database(empty_database_url: str) -> AsyncIterator[Database]:
    database = Database(create_db_engine(empty_database_url))
    yield database
    await database.dispose()


@pytest.fixture
def empty_db(empty_database: Database) -> async_sessionmaker[AsyncSession]:
    return empty_database.sessionmaker
