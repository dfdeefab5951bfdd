"""A client that disconnects mid-stream aborts its engine request; the row ends `cancelled`, billed so far."""

from __future__ import annotations

import asyncio
import json

import pytest
from litestar.types import Message

from ..harness import MODEL, Platform, asgi_scope, bearer

pytestmark = pytest.mark.anyio


async def test_disconnect_mid_stream_cancels_and_bills(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key()
    body = json.dumps(
        {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True, "stream": True}
    ).encode()
    gone = asyncio.Event()
    state = {"body_sent": False, "events": 0}

    async def receive() -> Message:
        if not state["body_sent"]:
            state["body_sent"] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            state["events"] += 1
            if state["events"] >= 4:  # role-less completion: 4 text deltas, then hang up
                gone.set()

    await asyncio.wait_for(platform.app(asgi_scope("/v1/completions", key), receive, send), timeout=120)

    [row] = (await platform.http.get("/v1/requests", headers=bearer(key))).json()["data"]
    assert row["status"] == "cancelled"
    assert 4 <= row["usage"]["completion_tokens"] < 200
    quota = await platform.services.quotas.usage(tenant["id"])
    assert (quota.concurrent, quota.outstanding) == (0, 0)
    assert quota.tokens_this_minute == row["usage"]["total_tokens"]
    for _ in range(100):  # the abort reaches the engine thread on its next turn
        if platform.services.engine.stats()["num_requests_running"] == 0:
            break
        await asyncio.sleep(0.05)
    assert platform.services.engine.stats()["num_requests_running"] == 0
