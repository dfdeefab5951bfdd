"""The Alembic migrations produce exactly the models' schema, on SQLite and on PostgreSQL, and fill new
columns of existing rows."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection, text

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


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_tenants_from_before_weights_get_weight_1(kind: str, fresh_database: Callable[[str], str]) -> None:
    url = fresh_database(kind)
    command.upgrade(alembic_config(url), "0002")

    async def insert_tenant() -> None:
        engine = create_db_engine(url)
        async with engine.begin() as connection:
            await connection.execute(
                text(
                    "INSERT INTO tenants (id, name, status, created_at, updated_at)"
                    " VALUES ('ten_old', 'old', 'active', :now, :now)"
                ),
                {"now": dt.datetime.now(dt.UTC)},
            )
        await engine.dispose()

    async def weight() -> float:
        engine = create_db_engine(url)
        async with engine.connect() as connection:
            found = await connection.scalar(text("SELECT weight FROM tenants WHERE id = 'ten_old'"))
        await engine.dispose()
        return found

    asyncio.run(insert_tenant())
    upgrade_head(url)
    assert asyncio.run(weight()) == 1.0
