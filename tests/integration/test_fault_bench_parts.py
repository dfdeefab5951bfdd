"""The fault bench's own parts (`pagewise bench faults` runs them against a whole stack): a private Redis that a
restart empties, and a proxy in front of PostgreSQL that cuts and refuses connections until restored."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import pytest
import redis

from pagewise.bench.fault_proxy import BackgroundProxy
from pagewise.bench.faults import private_redis

from .conftest import POSTGRES_ADMIN_DSN


def test_a_private_redis_restarts_empty(tmp_path: Path) -> None:
    with private_redis(tmp_path) as (url, restart):
        client = redis.Redis.from_url(url)
        client.set("k", "v")
        restart()
        assert client.get("k") is None and client.ping()
        client.close()


def test_the_background_proxy_cuts_and_restores_postgres() -> None:
    proxy = BackgroundProxy("127.0.0.1", 5432)
    try:
        dsn = POSTGRES_ADMIN_DSN.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        with psycopg.connect(dsn) as connection:
            assert connection.execute("SELECT 1").fetchone() == (1,)
            proxy.cut()
            time.sleep(0.2)  # the closed sockets reach the client
            with pytest.raises(psycopg.OperationalError):
                connection.execute("SELECT 1")
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(dsn, connect_timeout=5)
        proxy.restore()
        with psycopg.connect(dsn) as connection:
            assert connection.execute("SELECT 1").fetchone() == (1,)
    finally:
        proxy.close()
