"""Revision 0004 keeps usage recorded before it (not attributed to a key, cost 0); its downgrade merges a tenant's
per-key usage back into one row per (tenant, day, model)."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable

import pytest
from alembic import command
from sqlalchemy import text

from pagewise.platform.db.migrate import alembic_config, upgrade_head
from pagewise.platform.db.session import create_db_engine

_TENANT = (
    "INSERT INTO tenants (id, name, status, weight, created_at, updated_at)"
    " VALUES ('ten_old', 'old', 'active', 1.0, :now, :now)"
)


def _run(url: str, *statements: str) -> list:
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


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_usage_from_before_keys_survives_and_downgrade_merges_keys(kind: str, fresh_database: Callable[[str], str]):
    url = fresh_database(kind)
    command.upgrade(alembic_config(url), "0003")
    _run(
        url,
        _TENANT,
        "INSERT INTO usage_daily (tenant_id, day, model, requests, prompt_tokens, completion_tokens, cached_tokens)"
        " VALUES ('ten_old', '2030-01-02', 'm', 3, 30, 20, 10)",
    )
    upgrade_head(url)
    select = "SELECT api_key_id, requests, prompt_tokens, cost_micros FROM usage_daily ORDER BY api_key_id"
    assert _run(url, select) == [("", 3, 30, 0)]
    _run(
        url,
        "INSERT INTO usage_daily (tenant_id, day, model, api_key_id, requests, prompt_tokens, completion_tokens,"
        " cached_tokens, cost_micros) VALUES ('ten_old', '2030-01-02', 'm', 'key_a', 2, 5, 5, 0, 7)",
    )
    command.downgrade(alembic_config(url), "0003")
    assert _run(url, "SELECT requests, prompt_tokens, completion_tokens, cached_tokens FROM usage_daily") == [
        (5, 35, 25, 10)
    ]
