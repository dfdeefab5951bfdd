"""A real `pagewise jobs worker` process on the machine's Redis and a fresh PostgreSQL database (no eager mode),
and this process's Celery app configured like it, to queue tasks and wait for their results. One of each per
session: a process's Celery app takes one configuration. The worker exports its spans over OTLP to a receiver
of the session's. Tests that kill workers start their own (`start_worker`) under a key prefix of their own."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from pagewise.bench.otlp_receiver import Received, otlp_receiver
from pagewise.jobs.celery_app import configure
from pagewise.platform.db.migrate import upgrade_head
from pagewise.platform.keys.key_format import generate_key
from pagewise.platform.settings import Settings

from ..conftest import REDIS_URL

PAGEWISE = str(Path(sys.executable).with_name("pagewise"))


@dataclass(slots=True)
class Jobs:
    settings: Settings
    export_dir: Path
    spans: Received  # what the worker exported, as service "pagewise-jobs"

    def run(self, task: str, *args: object, timeout: float = 60, **kwargs: object) -> object:
        """Queue `task` and wait for the worker's result."""
        return configure(self.settings).send_task(task, args=args, kwargs=kwargs).get(timeout=timeout)

    def api_settings(self, database_url: str) -> Settings:
        """An API's settings on this worker's Redis, key prefix and export folder, with an admin key of its own."""
        shared = {f: getattr(self.settings, f) for f in ("redis_url", "redis_key_prefix", "export_dir")}
        return Settings.from_env(
            {}, **shared, database_url=database_url, auto_migrate=False, admin_key=generate_key().key
        )


def worker_env(database_url: str, prefix: str, export_dir: Path) -> dict[str, str]:
    """The platform settings a test's worker runs with."""
    return {
        "PAGEWISE_DATABASE_URL": database_url,
        "PAGEWISE_REDIS_URL": REDIS_URL,
        "PAGEWISE_REDIS_KEY_PREFIX": prefix,
        "PAGEWISE_EXPORT_DIR": str(export_dir),
        "PAGEWISE_RETENTION_DAYS": "20",
    }


def start_worker(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """`pagewise jobs worker` with one pool process, leading a process group of its own (so the whole worker can be
    signalled at once)."""
    return subprocess.Popen(
        [PAGEWISE, "jobs", "worker", "--concurrency", "1", "--loglevel", "warning"],
        env={**os.environ, **env},
        start_new_session=True,
    )


def stop_worker(worker: subprocess.Popen[bytes]) -> None:
    """A warm shutdown, or a kill when it takes longer than 30 s; a no-op for a worker already gone."""
    if worker.poll() is not None:
        return
    os.killpg(worker.pid, signal.SIGTERM)
    try:
        worker.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()


def drop_keys(prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(scope="session")
def jobs_database(fresh_database: Callable[[str], str]) -> str:
    url = fresh_database("postgres")
    upgrade_head(url)
    return url


@pytest.fixture(scope="session")
def jobs(jobs_database: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jobs]:
    prefix = f"pagewise_test_{secrets.token_hex(6)}:"
    export_dir = tmp_path_factory.mktemp("exports")
    env = worker_env(jobs_database, prefix, export_dir)
    with otlp_receiver() as spans:
        worker = start_worker({**env, "OTEL_EXPORTER_OTLP_ENDPOINT": spans.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"})
        try:
            yield Jobs(Settings.from_env(env), export_dir, spans)
        finally:
            stop_worker(worker)
            drop_keys(prefix)
