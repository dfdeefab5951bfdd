"""Revision 0004 keeps usage recorded before it (not attributed to a key, cost 0); its downgrade merges a tenant's
per-key usage back into one row per (tenant, day, model)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from alembic import command

from pagewise.platform.db.migrate import alembic_config, upgrade_head

from .sql import OLD_TENANT, run_sql


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_usage_from_before_keys_survives_and_downgrade_merges_keys(kind: str, fresh_database: Callable[[str], str]):
    url = fresh_database(kind)
    command.upgrade(alembic_config(url), "0003")
    run_sql(
        url,
        OLD_TENANT,
        "INSERT INTO usage_daily (tenant_id, day, model, requests, prompt_tokens, completion_tokens, cached_tokens)"
        " VALUES ('ten_old', '2030-01-02', 'm', 3, 30, 20, 10)",
    )
    upgrade_head(url)
    select = "SELECT api_key_id, requests, prompt_tokens, cost_micros FROM usage_daily ORDER BY api_key_id"
    assert run_sql(url, select) == [("", 3, 30, 0)]
    run_sql(
        url,
        "INSERT INTO usage_daily (tenant_id, day, model, api_key_id, requests, prompt_tokens, completion_tokens,"
        " cached_tokens, cost_micros) VALUES ('ten_old', '2030-01-02', 'm', 'key_a', 2, 5, 5, 0, 7)",
    )
    command.downgrade(alembic_config(url), "0003")
    assert run_sql(url, "SELECT requests, prompt_tokens, completion_tokens, cached_tokens FROM usage_daily") == [
        (5, 35, 25, 10)
    ]
