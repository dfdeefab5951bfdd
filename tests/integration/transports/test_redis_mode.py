"""An API replica in redis mode with no live worker: not ready, and every inference request is a 503 with
`Retry-After` that reserves nothing and writes no row."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy import func, select

from pagewise.platform.app import create_app
from pagewise.platform.db.models import RequestRecord
from pagewise.platform.keys.key_format import generate_key
from pagewise.platform.quotas.redis_store import RedisQuotaStore
from pagewise.platform.settings import Settings

from ..conftest import REDIS_URL
from ..harness import MODEL, Platform, bearer
from .conftest import with_admin

pytestmark = pytest.mark.anyio


@pytest.fixture
async def replica(database_url: str, redis_key_prefix: str) -> AsyncIterator[Platform]:
    settings = Settings.from_env(
        {}, database_url=database_url, auto_migrate=False, admin_key=generate_key().key, redis_url=REDIS_URL,
        redis_key_prefix=redis_key_prefix, engine_mode="redis",
    )
    quotas = RedisQuotaStore.from_url(REDIS_URL, redis_key_prefix)
    app = create_app(settings, quotas=quotas)
    async with app.lifespan():
        async for platform in with_admin(app):
            yield platform
    await quotas.close()


async def test_no_worker_means_503_and_no_state(replica: Platform) -> None:
    tenant, key = await replica.tenant_with_key()
    ready = await replica.http.get("/ready")
    assert ready.status_code == 503
    for path, body in (
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/requests", {"endpoint": "/v1/completions", "model": MODEL, "prompt": "Hi"}),
    ):
        response = await replica.http.post(path, json=body, headers=bearer(key))
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "engine_unavailable" and "Retry-After" in response.headers
    workers = await replica.http.get("/admin/workers", headers=bearer(replica.admin_key))
    assert workers.json() == {"object": "list", "data": []}
    async with replica.services.sessionmaker() as session:
        rows = await session.scalar(select(func.count()).where(RequestRecord.tenant_id == tenant["id"]))
    usage = await replica.services.quotas.usage(tenant["id"])
    assert rows == 0 and usage.requests_this_minute == 0 and usage.concurrent == 0
