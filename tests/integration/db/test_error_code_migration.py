"""Revision 0008 splits a failed row's "<code>: <message>" into `error_code` and `error` (a sweep's reason, which
had no code, reads as `worker_lost`); its downgrade joins them again."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from alembic import command

from pagewise.platform.db.migrate import alembic_config, upgrade_head

from .sql import OLD_TENANT, run_sql

_ROW = (
    "INSERT INTO requests (id, tenant_id, endpoint, model, input, params, status, prompt_tokens, completion_tokens,"
    " cached_tokens, queued_at, error) VALUES ('{id}', 'ten_old', 'completions', 'm', '{{}}', '{{}}', '{status}',"
    " 0, 0, 0, :now, {error})"
)
_ERRORS = "SELECT id, error_code, error FROM requests ORDER BY id"


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_error_strings_become_codes_and_back(kind: str, fresh_database: Callable[[str], str]):
    url = fresh_database(kind)
    command.upgrade(alembic_config(url), "0007")
    run_sql(
        url,
        OLD_TENANT,
        _ROW.format(id="a", status="failed", error="'internal_error: the engine failed: a: b'"),
        _ROW.format(id="b", status="failed", error="'orphaned: the process serving it stopped'"),
        _ROW.format(id="c", status="completed", error="NULL"),
    )
    upgrade_head(url)
    assert run_sql(url, _ERRORS) == [
        ("a", "internal_error", "the engine failed: a: b"),
        ("b", "worker_lost", "orphaned: the process serving it stopped"),
        ("c", None, None),
    ]
    command.downgrade(alembic_config(url), "0007")
    assert run_sql(url, "SELECT id, error FROM requests ORDER BY id") == [
        ("a", "internal_error: the engine failed: a: b"),
        ("b", "worker_lost: orphaned: the process serving it stopped"),
        ("c", None),
    ]
