"""The generated bootstrap admin key is written to one file per database: a first start on another database
never replaces the key of the first (issue: `make run`, then the distributed section, on one data directory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagewise.platform import app as app_module
from pagewise.platform.paths import admin_key_file

SQLITE = "sqlite+aiosqlite:////data/pagewise.db"
POSTGRES = "postgresql+asyncpg://postgres:secret@127.0.0.1/pagewise"


def test_each_database_has_its_own_file_under_the_data_directory(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    sqlite, postgres = admin_key_file(SQLITE), admin_key_file(POSTGRES)
    assert sqlite != postgres
    assert sqlite.parent == postgres.parent == tmp_path / "pagewise" / "admin-keys"
    assert sqlite.name.startswith("sqlite-pagewise.db-") and postgres.name.startswith("postgresql-pagewise-")
    assert admin_key_file(SQLITE) == sqlite  # the same database, the same file
    assert "secret" not in str(postgres)


def test_without_a_terminal_a_second_first_start_keeps_the_first_key(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))

    def no_terminal(path: str, *args: object, **kwargs: object) -> object:
        raise OSError("no controlling terminal")

    monkeypatch.setattr(app_module, "open", no_terminal, raising=False)
    app_module.announce_admin_key("pw_first", SQLITE)
    app_module.announce_admin_key("pw_second", POSTGRES)
    assert admin_key_file(SQLITE).read_text() == "pw_first\n"
    assert admin_key_file(POSTGRES).read_text() == "pw_second\n"
    assert admin_key_file(SQLITE).stat().st_mode & 0o777 == 0o600
