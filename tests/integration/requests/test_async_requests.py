"""`/v1/requests`: submit returns at once, poll to completion, cancel mid-way (billed), list with a cursor."""

from __future__ import annotations

import asyncio

import pytest

from ..harness import MODEL, Platform, bearer

pytestmark = pytest.mark.anyio


async def _wait_finished(platform: Platform, key: str, request_id: str) -> dict:
    for _ in range(600):
        row = (await platform.http.get(f"/v1/requests/{request_id}", headers=bearer(key))).json()
        if row["status"] not in ("queued", "running"):
            return row
        await asyncio.sleep(0.05)
    raise AssertionError(f"request {request_id} did not finish")


async def test_submit_poll_and_usage(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key()
    body = {
        "endpoint": "/v1/chat/completions",
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
    }
    created = await platform.http.post("/v1/requests", json=body, headers=bearer(key))
    assert created.status_code == 202 and created.json()["status"] in ("queued", "running")
    row = await _wait_finished(platform, key, created.json()["id"])
    assert row["status"] == "completed" and row["output"][0]["text"]
    assert row["usage"]["completion_tokens"] >= 1 and row["finished_at"] is not None
    usage = (await platform.http.get("/v1/usage", headers=bearer(key))).json()
    assert usage["object"] == "page"
    results = [r for bucket in usage["data"] for r in bucket["results"]]
    assert sum(r["num_model_requests"] for r in results) == 1
    assert sum(r["output_tokens"] for r in results) == row["usage"]["completion_tokens"]


async def test_cancel_bills_tokens_so_far(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key()
    body = {
        "endpoint": "/v1/completions",
        "model": MODEL,
        "prompt": "Write a long story.",
        "max_tokens": 200,
        "ignore_eos": True,
    }
    created = (await platform.http.post("/v1/requests", json=body, headers=bearer(key))).json()
    for _ in range(400):
        row = (await platform.http.get(f"/v1/requests/{created['id']}", headers=bearer(key))).json()
        if row["status"] == "running":
            break
        await asyncio.sleep(0.05)
    cancelled = (await platform.http.delete(f"/v1/requests/{created['id']}", headers=bearer(key))).json()
    assert cancelled["status"] == "cancelled"
    assert 0 < cancelled["usage"]["completion_tokens"] < 200
    quota = await platform.services.quotas.usage(tenant["id"])
    assert (quota.concurrent, quota.outstanding) == (0, 0)
    assert quota.tokens_this_minute == cancelled["usage"]["total_tokens"]
    assert platform.services.engine.stats()["num_requests_waiting"] == 0


async def test_list_is_paginated_newest_first(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    ids = [
        (await platform.http.post("/v1/completions", json=body, headers=bearer(key))).json()["id"]
        for _ in range(3)
    ]
    first = (await platform.http.get("/v1/requests", params={"limit": 2}, headers=bearer(key))).json()
    assert [r["id"] for r in first["data"]] == ids[::-1][:2] and first["has_more"] is True
    rest = (
        await platform.http.get(
            "/v1/requests", params={"limit": 2, "after": first["last_id"]}, headers=bearer(key)
        )
    ).json()
    assert [r["id"] for r in rest["data"]] == [ids[0]] and rest["has_more"] is False
