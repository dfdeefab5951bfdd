"""One home for the database engines' configuration: the synchronous engines (the jobs', the SQLite unit-of-work
thread's) get the same SQLite pragmas and busy timeout as the platform's async engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text

from pagewise.jobs.database import session_factory
from pagewise.platform.db.session import create_sync_db_engine, sync_url


def test_every_sync_sqlite_engine_has_the_platforms_pragmas(tmp_path: Path) -> None:
    platform_url, jobs_url = (f"sqlite+aiosqlite:///{tmp_path / name}" for name in ("p.db", "j.db"))
    for engine in (create_sync_db_engine(platform_url), session_factory(jobs_url).kw["bind"]):
        with engine.connect() as connection:  # each on a file of its own: WAL, once set, stays with the file
            assert connection.execute(text("PRAGMA foreign_keys")).scalar() == 1
            assert connection.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert connection.execute(text("PRAGMA busy_timeout")).scalar() == 30_000


def test_sync_urls() -> None:
    assert sync_url("postgresql+asyncpg://u:p@h/db") == "postgresql+psycopg://u:p@h/db"
    assert sync_url("sqlite+aiosqlite:///x.db") == "sqlite:///x.db"
    assert sync_url("sqlite:///x.db") == "sqlite:///x.db"
    with pytest.raises(ValueError, match="mysql"):
        sync_url("mysql+aiomysql://h/db")
