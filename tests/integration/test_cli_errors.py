"""The `pagewise` command as an operator meets it, run as a subprocess: a database it cannot open or a port that
is taken is one `error:` line and exit status 2 (never a traceback, never a password), before anything slow;
`--database-url` wins over the environment; the default database is one per user, whatever the directory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

NO_MODEL = "/nonexistent/model.gguf"  # serve would fail on it if it ever got as far as loading the model
REFUSED = "postgresql+asyncpg://postgres:hunter2@127.0.0.1:1/test"  # nothing listens on port 1


def pagewise(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`pagewise ARGV` with no `PAGEWISE_*` variable from this process; the per-user data lives under `cwd`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("PAGEWISE_")}
    environment = base | {"XDG_DATA_HOME": str(cwd / "xdg-data")} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "pagewise.cli", *argv],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_error_line(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    lines = result.stderr.splitlines()
    assert (result.returncode, result.stdout, len(lines)) == (2, "", 1), result.stderr
    assert lines[0].startswith("error: ") and all(f in lines[0] for f in fragments), lines[0]
    assert "hunter2" not in result.stderr


@pytest.fixture
def listening_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def test_an_unreachable_postgres_names_it_without_its_password(tmp_path: Path) -> None:
    result = pagewise("tenants", "list", "--database-url", REFUSED, cwd=tmp_path)
    assert_one_error_line(result, "postgresql+asyncpg://postgres:***@127.0.0.1:1/test", "Connect call failed")


def test_the_database_from_the_environment_is_checked_the_same_way(tmp_path: Path) -> None:
    result = pagewise("keys", "list", cwd=tmp_path, env={"PAGEWISE_DATABASE_URL": REFUSED})
    assert_one_error_line(result, "cannot open the database postgresql+asyncpg://postgres:***@127.0.0.1:1/test")


def test_a_missing_postgres_database_says_so(tmp_path: Path) -> None:
    url = "postgresql+asyncpg://postgres@127.0.0.1:5432/pagewise_no_such_database"
    assert_one_error_line(pagewise("db", "upgrade", "--database-url", url, cwd=tmp_path), 'database "pagewise_no_such')


def test_a_sqlite_file_in_a_missing_directory_names_the_directory(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'missing' / 'pagewise.db'}"
    result = pagewise("tenants", "create", "acme", "--database-url", url, cwd=tmp_path)
    assert_one_error_line(result, f"the directory {tmp_path / 'missing'} does not exist")


def test_database_url_wins_over_the_environment(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'flag.db'}"
    env = {"PAGEWISE_DATABASE_URL": REFUSED}
    assert pagewise("tenants", "create", "acme", "--database-url", url, cwd=tmp_path, env=env).returncode == 0
    listed = pagewise("tenants", "list", "--database-url", url, cwd=tmp_path, env=env)
    assert listed.returncode == 0 and "  acme  active" in listed.stdout


def test_the_default_database_is_the_same_from_every_directory(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    data = {"XDG_DATA_HOME": str(tmp_path / "data")}
    assert pagewise("tenants", "create", "acme", cwd=first, env=data).returncode == 0
    listed = pagewise("tenants", "list", cwd=second, env=data)
    assert listed.returncode == 0 and "  acme  active" in listed.stdout
    assert (tmp_path / "data" / "pagewise" / "pagewise.db").is_file()
    assert not list(first.glob("*.db")) and not list(second.glob("*.db"))


def test_serve_refuses_a_taken_port_before_it_opens_the_database(tmp_path: Path, listening_port: int) -> None:
    database = tmp_path / "serve.db"
    port = str(listening_port)
    result = pagewise(
        "serve", "--port", port, "--database-url", f"sqlite+aiosqlite:///{database}", "--model", NO_MODEL, cwd=tmp_path
    )
    assert_one_error_line(result, f"cannot listen on 127.0.0.1:{port}: Address already in use", "--port")
    assert not database.exists()


def test_serve_refuses_an_unreachable_database_before_loading_the_model(tmp_path: Path) -> None:
    result = pagewise("serve", "--port", "0", "--database-url", REFUSED, "--model", NO_MODEL, cwd=tmp_path)
    assert_one_error_line(result, "cannot open the database postgresql+asyncpg://postgres:***@127.0.0.1:1/test")


def test_serve_prints_its_database_then_refuses_a_model_it_cannot_find(
    tmp_path: Path, fresh_database: Callable[[str], str]
) -> None:
    url = fresh_database("postgres").replace("postgres@", "postgres:hunter2@", 1)  # trust auth ignores it
    result = pagewise("serve", "--port", "0", "--database-url", url, "--model", NO_MODEL, cwd=tmp_path)
    database, error = result.stderr.splitlines()
    assert database == f"pagewise: database {url.replace('hunter2', '***')}"
    assert (result.returncode, result.stdout) == (2, "") and error.startswith(f"error: model '{NO_MODEL}' not found")
    assert "hunter2" not in result.stderr


def test_serve_with_external_workers_needs_redis(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'api.db'}"
    result = pagewise("serve", "--workers-external", "--port", "0", "--database-url", url, cwd=tmp_path)
    assert_one_error_line(result, "needs PAGEWISE_REDIS_URL")


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_an_unreachable_redis_is_one_line_before_the_model_loads(tmp_path: Path, command: str) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'api.db'}"
    unreachable = {"PAGEWISE_REDIS_URL": "redis://:secret@127.0.0.1:1/0"}
    args = ["--port", "0"] if command == "serve" else []
    result = pagewise(command, *args, "--database-url", url, cwd=tmp_path, env=unreachable)
    errors = [line for line in result.stderr.splitlines() if not line.startswith("pagewise: ")]  # start-up summary
    assert (result.returncode, len(errors)) == (2, 1), result.stderr
    assert errors[0].startswith("error: cannot reach Redis at 127.0.0.1:1/0") and "secret" not in result.stderr


def test_a_worker_refuses_to_expose_metrics_to_the_network_without_the_token(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'api.db'}"
    env = {"PAGEWISE_REDIS_URL": "redis://127.0.0.1:6379/0"}
    args = ("--metrics-port", "0", "--metrics-host", "0.0.0.0", "--model", NO_MODEL, "--database-url", url)
    result = pagewise("worker", *args, cwd=tmp_path, env=env)
    assert_one_error_line(result, "--metrics-host 0.0.0.0 would serve per-tenant metrics to the network")
