"""PostgreSQL and Redis restarting under a serving API (their connections cut and refused for a while, through a
proxy): the API answers 503 (`database_unavailable`, `service_unavailable`) with `Retry-After` — never a 500 —
and `/ready` says 503; a request the engine was running while the database was away is finished and billed
once it is back; then everything serves again without a restart."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from urllib.parse import urlsplit

import pytest

from pagewise.bench.fault_proxy import CuttableProxy
from pagewise.engine.async_engine import AsyncLLMEngine
from pagewise.platform.app import create_app
from pagewise.platform.db.migrate import upgrade_head
from pagewise.platform.keys.key_format import generate_key
from pagewise.platform.quotas.memory_store import InProcessQuotaStore
from pagewise.platform.quotas.redis_store import RedisQuotaStore
from pagewise.platform.settings import Settings

from .conftest import REDIS_URL
from .harness import bearer, chat_body
from .transports.conftest import with_admin

pytestmark = pytest.mark.anyio


@pytest.fixture
def postgres_url(fresh_database: Callable[[str], str]) -> str:
    url = fresh_database("postgres")
    upgrade_head(url)
    return url


async def test_a_postgres_restart_is_503s_then_service_and_no_request_is_lost(
    postgres_url: str, llm_engine: AsyncLLMEngine
) -> None:
    url = postgres_url
    proxy = CuttableProxy("127.0.0.1", 5432)
    await proxy.start()
    through_proxy = url.replace("@127.0.0.1:5432/", f"@127.0.0.1:{proxy.port}/")
    settings = Settings.from_env({}, database_url=through_proxy, auto_migrate=False, admin_key=generate_key().key)
    app = create_app(settings, engine=llm_engine, quotas=InProcessQuotaStore())
    try:
        async with app.lifespan():
            async for platform in with_admin(app):
                _, key = await platform.tenant_with_key()
                chat = await platform.http.post("/v1/chat/completions", json=chat_body(), headers=bearer(key))
                assert chat.status_code == 200, chat.text

                proxy.cut()
                for answer in (
                    await platform.http.post("/v1/chat/completions", json=chat_body(), headers=bearer(key)),
                    await platform.http.get("/v1/requests", headers=bearer(key)),
                ):
                    assert answer.status_code == 503, answer.text
                    assert answer.json()["error"]["code"] == "database_unavailable"
                    assert answer.headers["retry-after"] == "2"
                ready = await platform.http.get("/ready")
                assert ready.status_code == 503 and ready.json()["database"] is False
                assert (await platform.http.get("/health")).status_code == 200
                proxy.restore()

                # a request running on the engine when the database goes: its final write waits for it
                body = chat_body("Tell me a story", max_tokens=24, ignore_eos=True)
                running = asyncio.create_task(platform.http.post("/v1/chat/completions", json=body,
                                                                 headers=bearer(key)))
                await asyncio.sleep(0.3)  # admitted (its row written) and decoding
                proxy.cut()
                await asyncio.sleep(1.5)
                proxy.restore()
                answer = await asyncio.wait_for(running, 60)
                assert answer.status_code == 200, answer.text
                assert answer.json()["usage"]["completion_tokens"] == 24
                [row] = [r for r in (await platform.http.get("/v1/requests", headers=bearer(key))).json()["data"]
                         if r["id"] == answer.json()["id"]]
                assert row["status"] == "completed" and row["usage"]["completion_tokens"] == 24

                again = await platform.http.post("/v1/chat/completions", json=chat_body(), headers=bearer(key))
                assert again.status_code == 200, again.text
                assert (await platform.http.get("/ready")).status_code == 200
    finally:
        await proxy.close()


async def test_the_quota_stores_redis_down_is_a_503_then_service(
    database_url: str, llm_engine: AsyncLLMEngine, redis_key_prefix: str
) -> None:
    """The API's quota store on a Redis whose connections are cut (a restart): admission answers 503
    `service_unavailable` with `Retry-After`, not 500, and `/ready` says so; served again once it is back."""
    upstream = urlsplit(REDIS_URL)
    proxy = CuttableProxy(upstream.hostname or "127.0.0.1", upstream.port or 6379)
    await proxy.start()
    quotas = RedisQuotaStore.from_url(f"redis://127.0.0.1:{proxy.port}/0", redis_key_prefix)
    settings = Settings.from_env({}, database_url=database_url, auto_migrate=False, admin_key=generate_key().key)
    app = create_app(settings, engine=llm_engine, quotas=quotas)
    try:
        async with app.lifespan():
            async for platform in with_admin(app):
                _, key = await platform.tenant_with_key()
                assert (await platform.http.post("/v1/chat/completions", json=chat_body(),
                                                 headers=bearer(key))).status_code == 200
                proxy.cut()
                answer = await platform.http.post("/v1/chat/completions", json=chat_body(), headers=bearer(key))
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] == "service_unavailable"
                assert answer.headers["retry-after"] == "2"
                ready = await platform.http.get("/ready")
                assert ready.status_code == 503 and ready.json()["quotas"] is False
                proxy.restore()
                again = await platform.http.post("/v1/chat/completions", json=chat_body(), headers=bearer(key))
                assert again.status_code == 200, again.text
    finally:
        await quotas.close()
        await proxy.close()
