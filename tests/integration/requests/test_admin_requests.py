"""`/admin/requests`: one row by id, the key that made it, and filters that are validated (400 naming them)."""

from __future__ import annotations

import pytest

from ..harness import MODEL, Platform, bearer

pytestmark = pytest.mark.anyio


async def test_one_request_by_id_names_its_key(platform: Platform) -> None:
    tenant = await platform.create_tenant()
    created = await platform.http.post(
        f"/admin/tenants/{tenant['id']}/keys", json={"scopes": ["inference"]}, headers=bearer(platform.admin_key)
    )
    key, key_id = created.json()["key"], created.json()["id"]
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    request_id = (await platform.http.post("/v1/completions", json=body, headers=bearer(key))).json()["id"]
    row = (await platform.http.get(f"/admin/requests/{request_id}", headers=bearer(platform.admin_key))).json()
    assert (row["id"], row["tenant_id"], row["api_key_id"]) == (request_id, tenant["id"], key_id)
    own = (await platform.http.get(f"/v1/requests/{request_id}", headers=bearer(key))).json()
    assert own["api_key_id"] == key_id
    missing = await platform.http.get("/admin/requests/cmpl_missing", headers=bearer(platform.admin_key))
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    listed = await platform.http.get(
        "/admin/requests",
        params={"tenant_id": tenant["id"], "status": "completed", "since": "2000-01-01T00:00:00"},
        headers=bearer(platform.admin_key),
    )
    assert [r["id"] for r in listed.json()["data"]] == [request_id]


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"status": "done"}, "status"),
        ({"since": "yesterday"}, "since"),
        ({"until": "2026-02-30T00:00:00Z"}, "until"),
        ({"since": "9999-12-31T23:59:59-05:00"}, "since"),
        ({"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"}, "until"),
        ({"limit": 0}, "limit"),
    ],
)
async def test_bad_filters_are_400s_naming_them(platform: Platform, params: dict, param: str) -> None:
    response = await platform.http.get("/admin/requests", params=params, headers=bearer(platform.admin_key))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
