"""The wheel ships the migrations, and `pagewise db upgrade` run from the installed wheel — not from a checkout —
brings an empty database to the head revision."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path

from alembic.script import ScriptDirectory

from pagewise.platform.db.migrate import MIGRATIONS_DIR

from .stack_files import REPO

FROM_THE_WHEEL = """
import sys
from pathlib import Path
from pagewise.platform.db import migrate
assert migrate.MIGRATIONS_DIR.is_relative_to(Path(sys.argv[1]).resolve()), migrate.MIGRATIONS_DIR
from pagewise.cli import main
sys.exit(main(["db", "upgrade", "--database-url", sys.argv[2]]))
"""


def _build_wheel(tmp_path: Path) -> Path:
    """A wheel of a clean copy of the sources (the checkout stays free of build/ and egg-info)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source)
    shutil.copytree(REPO / "pagewise", source / "pagewise", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, source],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = dist.glob("pagewise-*.whl")
    return wheel


def test_the_wheel_ships_the_migrations_and_upgrades_a_database(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    packaged = {p.relative_to(REPO).as_posix() for p in MIGRATIONS_DIR.rglob("*") if p.suffix in (".py", ".mako")}
    assert packaged - set(zipfile.ZipFile(wheel).namelist()) == set()

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # an install without the console script
    database = tmp_path / "from-wheel.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEWISE_")} | {"PYTHONPATH": str(site)}
    result = subprocess.run(
        [sys.executable, "-c", FROM_THE_WHEEL, str(site), f"sqlite+aiosqlite:///{database}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    with sqlite3.connect(database) as connection:
        (revision,) = connection.execute("SELECT version_num FROM alembic_version").fetchone()
    assert revision == ScriptDirectory(str(MIGRATIONS_DIR)).get_current_head()
