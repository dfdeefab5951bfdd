"""Run the Alembic migrations shipped inside this package (`db/migrations/`) — the only way the schema is created.

The configuration is built in code, not read from `alembic.ini`, so an installed wheel or an image migrates
exactly like a checkout; `alembic.ini` at the repository root points the `alembic` command at the same folder
for developers (`alembic revision --autogenerate`).
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def alembic_config(database_url: str) -> Config:
    """An Alembic configuration for the packaged migrations, pointed at `database_url`."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade_head(database_url: str) -> None:
    """`alembic upgrade head`. Blocking, with its own event loop: from async code, call it in a thread."""
    command.upgrade(alembic_config(database_url), "head")
