"""The server shares its engine fairly by default: each tenant's weight reaches the scheduler, and the
per-tenant counters and queues show in `/admin/engine` and `/metrics` while the tenant has work."""

from __future__ import annotations

import asyncio

import pytest

from pagewise.platform.settings import Settings

from ..harness import MODEL, Platform, bearer

pytestmark = pytest.mark.anyio


def test_the_server_defaults_to_fair_scheduling() -> None:
    assert Settings.from_env({}).engine.engine_kwargs()["scheduling_policy"] == "fair"
    assert Settings.from_env({"PAGEWISE_SCHEDULING_POLICY": "fcfs"}).engine.scheduling_policy == "fcfs"


async def test_tenant_weight_and_counters_are_exposed(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key(weight=3.0)
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 120, "ignore_eos": True}
    running = asyncio.create_task(platform.http.post("/v1/completions", json=body, headers=bearer(key)))
    admin = bearer(platform.admin_key)
    seen = None
    for _ in range(400):
        view = (await platform.http.get("/admin/engine", headers=admin)).json()
        seen = view["stats"]["tenants"].get(tenant["id"])
        if seen and seen["served"] > 0:
            break
        await asyncio.sleep(0.02)
    assert seen is not None and seen["weight"] == 3.0 and seen["running"] + seen["waiting"] == 1
    metrics = (await platform.http.get("/metrics", headers=admin)).text
    assert f'pagewise:tenant_served_tokens{{tenant="{tenant["id"]}"}}' in metrics
    assert (await running).status_code == 200
