"""The Alembic migrations produce exactly the models' schema, on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection

from pagewise.platform.db.migrate import alembic_config, upgrade_head
from pagewise.platform.db.models import Base
from pagewise.platform.db.session import create_db_engine


def _diff(connection: Connection) -> list:
    context = MigrationContext.configure(connection, opts={"compare_type": True})
    return compare_metadata(context, Base.metadata)


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_autogenerate_finds_no_difference(kind: str, fresh_database: Callable[[str], str]) -> None:
    url = fresh_database(kind)
    upgrade_head(url)

    async def diff() -> list:
        engine = create_db_engine(url)
        async with engine.connect() as connection:
            found = await connection.run_sync(_diff)
        await engine.dispose()
        return found

    assert asyncio.run(diff()) == []


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_downgrade_to_initial_and_back(kind: str, fresh_database: Callable[[str], str]) -> None:
    url = fresh_database(kind)
    upgrade_head(url)
    command.downgrade(alembic_config(url), "0001")
    upgrade_head(url)
