"""Priority classes over HTTP: a body's `priority` (vLLM's; lower runs first) reaches the engine, never better than
its key's `priority_class` allows (`interactive`, 0, when the key names none); the class is a key setting that
survives rotation, and bad values are 400s that change nothing. The engine's own handling of priorities is tested
in `tests/unit/engine`."""

from __future__ import annotations

import pytest

from ..harness import Platform, bearer, chat_body

pytestmark = pytest.mark.anyio


async def _key(platform: Platform, tenant_id: str, **settings) -> dict:
    response = await platform.http.post(
        f"/admin/tenants/{tenant_id}/keys", json=settings, headers=bearer(platform.admin_key)
    )
    assert response.status_code == 201, response.text
    return response.json()


async def _chat(platform: Platform, key: str, **extra) -> None:
    response = await platform.http.post(
        "/v1/chat/completions", json=chat_body(max_tokens=2, **extra), headers=bearer(key)
    )
    assert response.status_code == 200, response.text


async def test_the_body_priority_is_capped_by_the_keys_class(platform: Platform, engine_priorities) -> None:
    tenant = await platform.create_tenant()
    batch = await _key(platform, tenant["id"], priority_class="batch")
    free = await _key(platform, tenant["id"])
    assert (batch["priority_class"], free["priority_class"]) == ("batch", None)
    await _chat(platform, batch["key"])  # asks for 0 (the default): runs at the batch class, 1
    await _chat(platform, batch["key"], priority=-5)
    await _chat(platform, batch["key"], priority=7)  # worse than its class: as asked
    await _chat(platform, free["key"], priority=-5)  # no key may put itself ahead of the interactive class
    await _chat(platform, free["key"], priority=3)
    assert engine_priorities == [1, 1, 7, 0, 3]

    admin = bearer(platform.admin_key)
    rotate = f"/admin/tenants/{tenant['id']}/keys/{batch['id']}/rotate"
    rotated = await platform.http.post(rotate, json={}, headers=admin)
    assert rotated.status_code == 201, rotated.text
    assert rotated.json()["priority_class"] == "batch"  # rotation keeps the key's settings
    patched = await platform.http.patch(
        f"/admin/tenants/{tenant['id']}/keys/{rotated.json()['id']}", json={"priority_class": None}, headers=admin
    )
    assert patched.status_code == 200 and patched.json()["priority_class"] is None
    await _chat(platform, rotated.json()["key"])
    assert engine_priorities[-1] == 0


async def test_bad_priorities_are_400s(platform: Platform, engine_priorities) -> None:
    tenant, key = await platform.tenant_with_key()
    for bad in (10**7, 1.5, "high"):
        response = await platform.http.post(
            "/v1/chat/completions", json=chat_body(priority=bad), headers=bearer(key)
        )
        assert response.status_code == 400, response.text
        assert "priority" in response.json()["error"]["message"]
    admin = bearer(platform.admin_key)
    response = await platform.http.post(
        f"/admin/tenants/{tenant['id']}/keys", json={"priority_class": "urgent"}, headers=admin
    )
    assert response.status_code == 400 and "priority_class" in response.text
    assert engine_priorities == []
