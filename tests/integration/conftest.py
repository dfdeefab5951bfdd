"""Fixtures: PostgreSQL and SQLite databases migrated by Alembic, the real Redis, the real engine."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import redis.asyncio as redis
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.engine.async_engine import AsyncLLMEngine
from pagewise.platform.app import create_app
from pagewise.platform.db.database import Database
from pagewise.platform.db.migrate import upgrade_head
from pagewise.platform.db.session import create_db_engine, create_sessionmaker
from pagewise.platform.keys.key_format import generate_key
from pagewise.platform.keys.schemas import KeyCreate
from pagewise.platform.keys.service import KeyService
from pagewise.platform.quotas.memory_store import InProcessQuotaStore
from pagewise.platform.quotas.quota_store import QuotaStore
from pagewise.platform.quotas.redis_store import RedisQuotaStore
from pagewise.platform.settings import Settings
from pagewise.platform.tenants.schemas import TenantCreate
from pagewise.platform.tenants.service import TenantService

from .harness import Platform

POSTGRES_ADMIN_DSN = os.environ.get("PAGEWISE_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("PAGEWISE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
TEST_MODEL = "smollm2-135m-instruct"
TEST_MAX_MODEL_LEN = 512
FROZEN_NOW = 1_800_000_030.0  # mid-minute, mid-month: quota windows never roll over during a test


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


async def _postgres_admin(sql: str) -> None:
    connection = await asyncpg.connect(POSTGRES_ADMIN_DSN)
    try:
        await connection.execute(sql)
    finally:
        await connection.close()


def _postgres_url(name: str) -> str:
    base = POSTGRES_ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://")
    return f"{base}/{name}"


@pytest.fixture(scope="session")
def fresh_database() -> Iterator[Callable[[str], str]]:
    """A factory of empty databases (`sqlite` or `postgres`), all dropped at the session's end."""
    created: list[str] = []
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"pagewise_test_{secrets.token_hex(4)}"
    tmp.mkdir(parents=True)

    def make(kind: str) -> str:
        name = f"pagewise_test_{secrets.token_hex(6)}"
        if kind == "sqlite":
            return f"sqlite+aiosqlite:///{tmp / name}.db"
        asyncio.run(_postgres_admin(f'CREATE DATABASE "{name}"'))
        created.append(name)
        return _postgres_url(name)

    yield make
    for name in created:
        asyncio.run(_postgres_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    for path in tmp.iterdir():
        path.unlink()
    tmp.rmdir()


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, fresh_database: Callable[[str], str]) -> str:
    """A migrated database of each kind, shared by the session; tests isolate themselves by fresh tenants."""
    url = fresh_database(request.param)
    upgrade_head(url)
    return url


@pytest.fixture
def redis_key_prefix() -> Iterator[str]:
    """A Redis key prefix of this test's own; its keys are deleted afterwards."""
    prefix = f"pagewise_test_{secrets.token_hex(6)}:"
    yield prefix

    async def cleanup() -> None:
        client = redis.Redis.from_url(REDIS_URL)
        keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()

    asyncio.run(cleanup())


QuotaStoreFactory = Callable[..., QuotaStore]


@pytest.fixture(params=["memory", "redis"])
async def quota_store_factory(
    request: pytest.FixtureRequest, redis_key_prefix: str
) -> AsyncIterator[QuotaStoreFactory]:
    """Makes stores of one kind (`memory` or `redis`): `factory(clock, lease_s=…)`; all closed afterwards."""
    stores: list[QuotaStore] = []

    def make(clock: Callable[[], float], **options: float) -> QuotaStore:
        store: QuotaStore
        if request.param == "memory":
            store = InProcessQuotaStore(clock, **options)
        else:
            store = RedisQuotaStore.from_url(REDIS_URL, redis_key_prefix, clock, **options)
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.close()


@pytest.fixture
def quota_store(quota_store_factory: QuotaStoreFactory) -> QuotaStore:
    """Both quota stores on a frozen clock, so the same tests prove the same semantics."""
    return quota_store_factory(lambda: FROZEN_NOW)


@pytest.fixture(scope="session")
def llm_engine() -> Iterator[AsyncLLMEngine]:
    """The real default model, loaded once per session and shared by every app under test."""
    from pagewise.engine.config import EngineConfig

    # as served (in fp32: the served tests compare outputs with the exact path's)
    config = EngineConfig(model=TEST_MODEL, max_model_len=TEST_MAX_MODEL_LEN, scheduling_policy="fair", dtype="float32")
    engine = AsyncLLMEngine(config, progress=False)
    yield engine
    engine.shutdown()


@pytest.fixture
def cli(database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """Run one `pagewise` admin command on the test's database; (exit code, stdout lines, stderr lines)."""
    from pagewise.cli import main

    monkeypatch.setenv("PAGEWISE_DATABASE_URL", database_url)

    def run(*argv: str) -> tuple[int, list[str], list[str]]:
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out.splitlines(), err.splitlines()

    return run


@pytest.fixture
async def database(database_url: str) -> AsyncIterator[Database]:
    """The test's database as the platform's request path uses it, outside any app."""
    database = Database(create_db_engine(database_url))
    yield database
    await database.dispose()


@pytest.fixture
async def session(database_url: str) -> AsyncIterator[AsyncSession]:
    """A session on the test's database, outside any app."""
    engine = create_db_engine(database_url)
    async with create_sessionmaker(engine)() as session:
        yield session
    await engine.dispose()


@pytest.fixture
def platform_quota_store() -> QuotaStore:
    """The store the `platform` app uses: in-process on a frozen clock (a test's windows never roll over, so
    its reserved and reconciled tokens stay comparable); quota suites override it with both stores."""
    return InProcessQuotaStore(lambda: FROZEN_NOW)


@pytest.fixture
def platform_settings() -> dict[str, Any]:
    """Settings the `platform` app is built with beyond the test's database (a suite overrides it)."""
    return {}


@pytest.fixture
async def platform(
    database_url: str, llm_engine: AsyncLLMEngine, platform_quota_store: QuotaStore, platform_settings: dict[str, Any]
) -> AsyncIterator[Platform]:
    """The app on each database, driven over ASGI in the test's loop (so concurrent requests overlap)."""
    # a chosen bootstrap key: the app never writes a generated one anywhere (a terminal, a file) in tests
    settings = Settings.from_env(
        {}, database_url=database_url, auto_migrate=False, admin_key=generate_key().key, **platform_settings
    )
    app = create_app(settings, engine=llm_engine, quotas=platform_quota_store)
    async with app.lifespan():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as http:
            async with app.state.sessionmaker() as session:
                ops = await TenantService(session).create(TenantCreate(name=f"ops-{secrets.token_hex(4)}"))
                admin = await KeyService(session).create(ops.id, KeyCreate(scopes=["admin"]))
            yield Platform(app, http, app.state.services, admin.key)


@pytest.fixture
def engine_priorities(platform: Platform, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The `priority` each request of the `platform` app reached its engine with, in order."""
    engine = platform.services.engine.transport.host.engine
    seen: list[int] = []
    generate = engine.generate

    def recording(*args, **kwargs):
        seen.append(kwargs["priority"])
        return generate(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", recording)
    return seen
