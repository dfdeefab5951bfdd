"""The engine's lease heartbeat keeps live requests' claims fresh; the sweep fails rows a dead engine left."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from pagewise.platform.db.models import RequestRecord, as_utc
from pagewise.platform.inference.leases import sweep
from pagewise.platform.requests.store import ORPHANED, row_error

from ..harness import MODEL, Platform, bearer
from ..requests.rows import request_row

pytestmark = pytest.mark.anyio


async def test_heartbeat_renews_a_live_request_and_fails_an_orphan(platform: Platform) -> None:
    services = platform.services
    tenant, key = await platform.tenant_with_key()
    now = dt.datetime.now(dt.UTC)
    # a row another replica admitted and then died with: its lease ran out a minute ago
    orphan = request_row(tenant["id"], "completions", now - dt.timedelta(minutes=5),
                         lease_expires_at=now - dt.timedelta(minutes=1))
    await services.requests.create(orphan)
    body = {"endpoint": "/v1/completions", "model": MODEL, "prompt": "Story:", "max_tokens": 200, "ignore_eos": True}
    submitted = await platform.http.post("/v1/requests", json=body, headers=bearer(key))
    assert submitted.status_code == 202, submitted.text
    live_id = submitted.json()["id"]
    async with services.sessionmaker() as session:
        first_lease = as_utc((await session.get(RequestRecord, live_id)).lease_expires_at)

    host = services.engine.transport.host  # the embedded engine's host
    await asyncio.sleep(0.01)
    await host.renew()
    assert await sweep(services.requests) == 1

    async with services.sessionmaker() as session:
        live = await session.get(RequestRecord, live_id)
        gone = await session.get(RequestRecord, orphan.id)
    assert live.status in ("queued", "running") and as_utc(live.lease_expires_at) > first_lease
    assert (gone.status, row_error(gone)) == ("failed", ORPHANED)
    cancelled = await platform.http.delete(f"/v1/requests/{live_id}", headers=bearer(key))
    assert cancelled.json()["status"] == "cancelled"
    assert live_id not in host.live
    assert (await services.quotas.usage(tenant["id"])).concurrent == 0
