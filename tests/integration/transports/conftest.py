"""`served`: the platform on each transport — the in-process loopback, and Redis Streams to a worker.

The Redis variant runs the real `RedisWorker` (its own inbox, heartbeats, pub/sub aborts) over the session's
engine in the test's own event loop, against the machine's Redis; the app loads no engine of its own.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as redis
from litestar import Litestar

from pagewise.engine.async_engine import AsyncLLMEngine
from pagewise.platform.app import create_app
from pagewise.platform.keys.key_format import generate_key
from pagewise.platform.keys.schemas import KeyCreate
from pagewise.platform.keys.service import KeyService
from pagewise.platform.quotas.redis_store import RedisQuotaStore
from pagewise.platform.requests.store import RequestStore
from pagewise.platform.settings import Settings
from pagewise.platform.tenants.schemas import TenantCreate
from pagewise.platform.tenants.service import TenantService
from pagewise.serving.host import EngineHost
from pagewise.serving.protocol import RedisKeys
from pagewise.worker.redis_worker import RedisWorker

from ..conftest import REDIS_URL
from ..harness import Platform


async def with_admin(app: Litestar) -> AsyncIterator[Platform]:
    """The app over ASGI, with an admin key of a tenant of its own (the database may hold other admins)."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as http:
        async with app.state.sessionmaker() as session:
            ops = await TenantService(session).create(TenantCreate(name=f"ops-{secrets.token_hex(4)}"))
            admin = await KeyService(session).create(ops.id, KeyCreate(scopes=["admin"]))
        yield Platform(app, http, app.state.services, admin.key)


@pytest.fixture(params=["loopback", "redis"])
async def served(
    request: pytest.FixtureRequest, database_url: str, llm_engine: AsyncLLMEngine, redis_key_prefix: str
) -> AsyncIterator[Platform]:
    common = {"database_url": database_url, "auto_migrate": False, "admin_key": generate_key().key}
    quotas = RedisQuotaStore.from_url(REDIS_URL, redis_key_prefix)
    if request.param == "loopback":
        settings = Settings.from_env({}, **common)
        app = create_app(settings, engine=llm_engine, quotas=quotas)
        async with app.lifespan():
            async for platform in with_admin(app):
                yield platform
        await quotas.close()
        return
    settings = Settings.from_env(
        {}, **common, redis_url=REDIS_URL, redis_key_prefix=redis_key_prefix, engine_mode="redis",
        worker_heartbeat_s=0.2,
    )
    app = create_app(settings, quotas=quotas)
    async with app.lifespan():
        host = EngineHost(llm_engine, RequestStore(app.state.services.database), quotas)
        client = redis.Redis.from_url(REDIS_URL)
        worker = RedisWorker(host, client, RedisKeys(redis_key_prefix), worker_id="w-test", heartbeat_s=0.2)
        running = asyncio.get_running_loop().create_task(worker.run())
        try:
            async for platform in with_admin(app):
                for _ in range(100):  # the API sees the worker at its next refresh
                    if (await platform.http.get("/ready")).status_code == 200:
                        break
                    await asyncio.sleep(0.1)
                yield platform
        finally:
            worker.stop()
            await _within(running, STOP_TIMEOUT_S)
            await client.aclose()


STOP_TIMEOUT_S = 120.0  # the worker's own stop is bounded well below this (grace, then abort)


async def _within(task: asyncio.Task[None], seconds: float) -> None:
    """Await `task`; past `seconds`, fail with the stack of every task of the loop (where a stop hangs)."""
    done, _ = await asyncio.wait([task], timeout=seconds)
    if not done:
        stacks = "\n".join(f"{other.get_name()}: {' <- '.join(_awaiting(other))}" for other in asyncio.all_tasks())
        task.cancel()
        pytest.fail(f"the worker did not stop within {seconds:.0f} s; tasks, each with what it awaits:\n{stacks}")
    task.result()


def _awaiting(task: asyncio.Task) -> list[str]:
    """The chain of coroutines `task` is suspended in, outermost first (`get_stack` shows only the first)."""
    chain, coro = [], task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            chain.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return chain
