"""Raw SQL against a migrated database, for the migration tests (which run below the ORM's models)."""

from __future__ import annotations

import asyncio
import datetime as dt

from sqlalchemy import text

from pagewise.platform.db.session import create_db_engine

# a tenant row written below the models (any revision has these columns), for the rows a migration test needs
OLD_TENANT = (
    "INSERT INTO tenants (id, name, status, weight, created_at, updated_at)"
    " VALUES ('ten_old', 'old', 'active', 1.0, :now, :now)"
)


def run_sql(url: str, *statements: str) -> list:
    """Run `statements` in one transaction (`:now` bound to the current time); the last result's rows."""

    async def go() -> list:
        engine = create_db_engine(url)
        rows: list = []
        async with engine.begin() as connection:
            for statement in statements:
                result = await connection.execute(text(statement), {"now": dt.datetime.now(dt.UTC)})
                rows = list(result.all()) if result.returns_rows else rows
        await engine.dispose()
        return rows

    return asyncio.run(go())
