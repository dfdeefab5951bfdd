"""Run the Alembic migrations in `migrations/` — the only way the schema is created."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

REPO_ROOT = Path(__file__).resolve().parents[3]


def alembic_config(database_url: str) -> Config:
    """`alembic.ini` at the repository root, pointed at `database_url`."""
    config = Config(str(REPO_ROOT / "alembic.ini"))
    config.set_main_option("script_location", str(REPO_ROOT / "migrations"))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade_head(database_url: str) -> None:
    """`alembic upgrade head`. Blocking, with its own event loop: from async code, call it in a thread."""
    command.upgrade(alembic_config(database_url), "head")
