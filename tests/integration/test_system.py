"""Health, readiness, OpenAPI, metrics and the admin views a dashboard reads."""

from __future__ import annotations

import httpx
import pytest

from pagewise.engine.async_engine import AsyncLLMEngine
from pagewise.platform.app import create_app
from pagewise.platform.keys.key_format import generate_key
from pagewise.platform.quotas.memory_store import InProcessQuotaStore
from pagewise.platform.quotas.redis_store import RedisQuotaStore
from pagewise.platform.settings import Settings

from .harness import MODEL, Platform, bearer

METRICS_TOKEN = "metrics-" + "t" * 40

pytestmark = pytest.mark.anyio


async def test_health_ready_and_schema_need_no_key(platform: Platform) -> None:
    assert (await platform.http.get("/health")).json() == {"status": "ok"}
    ready = await platform.http.get("/ready")
    assert ready.status_code == 200 and ready.json()["model_loaded"] and ready.json()["database"]
    assert ready.json()["quotas"] is True
    schema = (await platform.http.get("/schema/openapi.json")).json()
    assert "/v1/chat/completions" in schema["paths"] and "/admin/tenants" in schema["paths"]


async def test_ready_is_503_while_the_quota_stores_redis_is_down(
    database_url: str, llm_engine: AsyncLLMEngine, redis_key_prefix: str
) -> None:
    """Nothing listens where the quota store's Redis should be: every admission would fail, so not ready."""
    settings = Settings.from_env({}, database_url=database_url, auto_migrate=False, admin_key=generate_key().key)
    down = RedisQuotaStore.from_url("redis://127.0.0.1:1/0", redis_key_prefix)
    app = create_app(settings, engine=llm_engine, quotas=down)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    async with app.lifespan(), client as http:
        ready = await http.get("/ready")
    await down.close()
    assert ready.status_code == 503
    assert ready.json() == {"status": "not_ready", "model_loaded": True, "database": True, "quotas": False}


async def test_metrics_and_admin_views(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key(max_concurrent_requests=1)
    await platform.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}, headers=bearer(key)
    )
    text = (await platform.http.get("/metrics", headers=bearer(platform.admin_key))).text
    for name in (
        "pagewise:num_requests_running",
        "pagewise:kv_cache_usage_perc",
        "pagewise:prefix_cache_hits_total",
        "pagewise:prompt_tokens_total",
        "pagewise:time_to_first_token_seconds_bucket",
        "pagewise:e2e_request_latency_seconds_bucket",
    ):
        assert name in text, name
    assert (
        f'pagewise_requests_total{{endpoint="completions",status="completed",tenant="{tenant["id"]}"}} 1.0'
        in text
    )

    admin = bearer(platform.admin_key)
    usage = (
        await platform.http.get(
            "/admin/usage",
            params={"group_by": ["tenant_id", "model"], "tenant_id": tenant["id"]},
            headers=admin,
        )
    ).json()
    [result] = [r for b in usage["data"] for r in b["results"]]
    assert (
        result["tenant_id"] == tenant["id"] and result["model"] == MODEL and result["num_model_requests"] == 1
    )
    hourly = (
        await platform.http.get(
            "/admin/usage", params={"bucket_width": "1h", "tenant_id": tenant["id"]}, headers=admin
        )
    ).json()
    assert sum(r["num_model_requests"] for b in hourly["data"] for r in b["results"]) == 1
    listed = (
        await platform.http.get(
            "/admin/requests", params={"tenant_id": tenant["id"], "status": "completed"}, headers=admin
        )
    ).json()
    assert len(listed["data"]) == 1
    engine = (await platform.http.get("/admin/engine", headers=admin)).json()
    assert engine["model"] == MODEL and "kv_cache_usage_perc" in engine["stats"]
    overview = (await platform.http.get("/admin/overview", headers=admin)).json()
    assert overview["requests_by_status"]["completed"] >= 1
    assert (
        any(t["tenant_id"] == tenant["id"] for t in overview["top_tenants"])
        or len(overview["top_tenants"]) == 5
    )


async def test_metrics_need_an_admin_key(platform: Platform) -> None:
    """No or a wrong bearer is a 401; a valid key without the admin scope is a 403, as on admin routes."""
    _, inference_key = await platform.tenant_with_key()
    for headers in ({}, {"Authorization": "Basic abc"}, bearer("not-the-token"), bearer(inference_key[:-2] + "xx")):
        response = await platform.http.get("/metrics", headers=headers)
        assert response.status_code == 401, headers
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
    refused = await platform.http.get("/metrics", headers=bearer(inference_key))
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "insufficient_scope"
    allowed = await platform.http.get("/metrics", headers=bearer(platform.admin_key))
    assert allowed.status_code == 200 and "pagewise:num_requests_running" in allowed.text


async def test_metrics_token(database_url: str, llm_engine: AsyncLLMEngine) -> None:
    settings = Settings.from_env(
        {}, database_url=database_url, auto_migrate=False, metrics_token=METRICS_TOKEN, admin_key=generate_key().key
    )
    app = create_app(settings, engine=llm_engine, quotas=InProcessQuotaStore())
    async with app.lifespan():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            allowed = await http.get("/metrics", headers=bearer(METRICS_TOKEN))
            assert allowed.status_code == 200 and "pagewise:num_requests_running" in allowed.text
            for wrong in (METRICS_TOKEN[:-1], METRICS_TOKEN + "x", ""):
                assert (await http.get("/metrics", headers=bearer(wrong))).status_code == 401
            assert (await http.get("/health")).status_code == 200
