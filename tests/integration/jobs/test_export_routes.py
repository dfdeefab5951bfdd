"""`/admin/exports`: `POST` checks the tenant and the period, then queues the export on the real worker (202);
the listing shows the revision and a download returns its file with the hash it records."""

from __future__ import annotations

import asyncio
import hashlib
import secrets

import httpx
import pytest

from pagewise.platform.app import create_app
from pagewise.platform.keys.schemas import KeyCreate
from pagewise.platform.keys.service import KeyService
from pagewise.platform.tenants.schemas import TenantCreate
from pagewise.platform.tenants.service import TenantService

from ..harness import bearer
from .conftest import Jobs

pytestmark = pytest.mark.anyio


async def test_queue_list_and_download_an_export(jobs: Jobs, jobs_database: str, llm_engine) -> None:
    settings = jobs.api_settings(jobs_database)
    app = create_app(settings, engine=llm_engine)
    transport = httpx.ASGITransport(app=app)
    async with app.lifespan(), httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        async with app.state.sessionmaker() as session:  # the database is shared: bootstrap may have run
            ops = await TenantService(session).create(TenantCreate(name=f"ops-{secrets.token_hex(4)}"))
            admin = bearer((await KeyService(session).create(ops.id, KeyCreate(scopes=["admin"]))).key)
        tenant = await http.post("/admin/tenants", json={"name": f"exp-{secrets.token_hex(4)}"}, headers=admin)
        tenant_id = tenant.json()["id"]
        for body, status, param in (
            ({"tenant_id": "ten_missing", "period": "2026-01"}, 404, "id"),
            ({"tenant_id": tenant_id, "period": "2026-1"}, 400, "period"),
            ({"tenant_id": tenant_id, "period": "2999-01"}, 400, "period"),
            ({"tenant_id": tenant_id, "period": "2026-01", "format": "xml"}, 400, "format"),
        ):
            refused = await http.post("/admin/exports", json=body, headers=admin)
            assert (refused.status_code, refused.json()["error"]["param"]) == (status, param), refused.text
        queued = await http.post("/admin/exports", json={"tenant_id": tenant_id, "period": "2026-01"}, headers=admin)
        assert queued.status_code == 202, queued.text
        listed: list = []
        for _ in range(300):
            listed = (await http.get("/admin/exports", params={"tenant_id": tenant_id}, headers=admin)).json()
            if listed:
                break
            await asyncio.sleep(0.1)
        assert [(e["period"], e["revision"], e["num_rows"], e["total_cost_micros"]) for e in listed] == [
            ("2026-01", 1, 0, 0)
        ]
        download = await http.get(f"/admin/exports/{listed[0]['id']}/csv", headers=admin)
        assert download.status_code == 200 and download.headers["content-type"].startswith("text/csv")
        assert hashlib.sha256(download.content).hexdigest() == download.headers["x-content-sha256"]
        assert download.content.decode().splitlines()[-1].startswith(f"total,{tenant_id},2026-01,")
        assert (await http.get(f"/admin/exports/{listed[0]['id']}/xml", headers=admin)).status_code == 400
        assert (await http.get("/admin/exports/exp_missing/csv", headers=admin)).status_code == 404
