"""Key bodies are strict; a key lists with its status; rotation refuses dead keys and can keep the old key
working for a grace period."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from sqlalchemy import update

from pagewise.platform.db.models import ApiKey, as_utc

from ..harness import Platform, bearer

pytestmark = pytest.mark.anyio


def _at(value: str) -> dt.datetime:
    return as_utc(dt.datetime.fromisoformat(value))


async def _post_key(platform: Platform, tenant_id: str, body: dict[str, Any]) -> Any:
    return await platform.http.post(f"/admin/tenants/{tenant_id}/keys", json=body, headers=bearer(platform.admin_key))


async def _listed(platform: Platform, tenant_id: str) -> dict[str, dict[str, Any]]:
    response = await platform.http.get(f"/admin/tenants/{tenant_id}/keys", headers=bearer(platform.admin_key))
    return {k["id"]: k for k in response.json()}


async def _rotate(platform: Platform, tenant_id: str, key_id: str, body: Any = None) -> Any:
    return await platform.http.post(
        f"/admin/tenants/{tenant_id}/keys/{key_id}/rotate", json=body, headers=bearer(platform.admin_key)
    )


async def _works(platform: Platform, key: str) -> bool:
    return (await platform.http.get("/v1/models", headers=bearer(key))).status_code == 200


async def _expire(platform: Platform, key_id: str) -> None:
    async with platform.services.sessionmaker() as session:
        past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        await session.execute(update(ApiKey).where(ApiKey.id == key_id).values(expires_at=past))
        await session.commit()


async def test_key_bodies_are_strict_and_bounded(platform: Platform) -> None:
    tenant = await platform.create_tenant()
    refusals = [
        ({"nmae": "ci"}, None, "nmae"),
        ({"name": "x" * 201}, "name", "at most 200 characters"),
        ({"name": "ci\u0000"}, "name", "U+0000"),
        ({"name": "ci\rx"}, "name", "U+000D"),
        ({"expires_at": "2001-01-01T00:00:00Z"}, "expires_at", "in the future"),
        ({"expires_at": "9999-12-31T23:00:00-05:00"}, "expires_at", "at most 9999-12-31T23:59:59Z"),
        ({"scopes": []}, "scopes", "at least one"),
    ]
    for body, param, text in refusals:
        response = await _post_key(platform, tenant["id"], body)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert text in error["message"], body
        if param is not None:
            assert error["param"] == param, body
    assert await _listed(platform, tenant["id"]) == {}


async def test_expiry_is_stored_in_utc(platform: Platform) -> None:
    tenant = await platform.create_tenant()
    for sent, meant in (
        ("2099-01-01T02:00:00+02:00", dt.datetime(2099, 1, 1, tzinfo=dt.UTC)),
        ("2099-01-01T00:00:00", dt.datetime(2099, 1, 1, tzinfo=dt.UTC)),  # naive: UTC
        ("9999-12-31T23:59:59Z", dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.UTC)),
    ):
        created = await _post_key(platform, tenant["id"], {"expires_at": sent})
        assert created.status_code == 201, created.text
        assert created.json()["status"] == "active" and _at(created.json()["expires_at"]) == meant
        assert _at((await _listed(platform, tenant["id"]))[created.json()["id"]]["expires_at"]) == meant


async def test_keys_list_with_their_status(platform: Platform) -> None:
    tenant = await platform.create_tenant()
    ids = [(await _post_key(platform, tenant["id"], {"name": n})).json()["id"] for n in ("a", "b", "c")]
    await platform.http.delete(f"/admin/tenants/{tenant['id']}/keys/{ids[1]}", headers=bearer(platform.admin_key))
    await _expire(platform, ids[2])
    listed = await _listed(platform, tenant["id"])
    assert [listed[i]["status"] for i in ids] == ["active", "revoked", "expired"]


async def test_a_revoked_or_expired_key_cannot_be_rotated(platform: Platform) -> None:
    tenant = await platform.create_tenant()
    revoked, expired = [(await _post_key(platform, tenant["id"], {})).json()["id"] for _ in range(2)]
    await platform.http.delete(f"/admin/tenants/{tenant['id']}/keys/{revoked}", headers=bearer(platform.admin_key))
    await _expire(platform, expired)
    for key_id, code in ((revoked, "key_revoked"), (expired, "key_expired")):
        response = await _rotate(platform, tenant["id"], key_id)
        assert response.status_code == 409
        assert (response.json()["error"]["code"], response.json()["error"]["type"]) == (code, "conflict_error")
    assert len(await _listed(platform, tenant["id"])) == 2  # no key was issued


async def test_rotation_with_a_grace_period(platform: Platform) -> None:
    tenant = await platform.create_tenant()
    expiry = dt.datetime.now(dt.UTC).replace(microsecond=0) + dt.timedelta(days=30)
    old = (
        await _post_key(
            platform, tenant["id"], {"name": "ci", "scopes": ["inference"], "expires_at": expiry.isoformat()}
        )
    ).json()
    for body, param in (({"grace_period_s": 604_801}, "grace_period_s"), ({"grace": 60}, "grace")):
        refused = await _rotate(platform, tenant["id"], old["id"], body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    assert list(await _listed(platform, tenant["id"])) == [old["id"]]

    before = dt.datetime.now(dt.UTC)
    rotated = await _rotate(platform, tenant["id"], old["id"], {"grace_period_s": 3600})
    assert rotated.status_code == 201
    new = rotated.json()
    assert (new["name"], new["scopes"], new["status"]) == ("ci", ["inference"], "active")
    assert _at(new["expires_at"]) == expiry
    assert await _works(platform, old["key"]) and await _works(platform, new["key"])
    old_now = (await _listed(platform, tenant["id"]))[old["id"]]
    assert old_now["status"] == "active" and old_now["revoked_at"] is None
    grace_end = _at(old_now["expires_at"]) - before
    assert dt.timedelta(seconds=3599) <= grace_end <= dt.timedelta(seconds=3660)

    await _expire(platform, old["id"])  # the grace period is over
    assert not await _works(platform, old["key"]) and await _works(platform, new["key"])


async def test_grace_never_extends_an_earlier_expiry(platform: Platform) -> None:
    tenant = await platform.create_tenant()
    soon = dt.datetime.now(dt.UTC).replace(microsecond=0) + dt.timedelta(minutes=10)
    old = (await _post_key(platform, tenant["id"], {"expires_at": soon.isoformat()})).json()
    rotated = await _rotate(platform, tenant["id"], old["id"], {"grace_period_s": 604_800})
    assert rotated.status_code == 201 and _at(rotated.json()["expires_at"]) == soon
    assert _at((await _listed(platform, tenant["id"]))[old["id"]]["expires_at"]) == soon


async def test_rotation_without_a_body_revokes_at_once(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key()
    [old_id] = await _listed(platform, tenant["id"])
    rotated = await _rotate(platform, tenant["id"], old_id)
    assert rotated.status_code == 201
    assert not await _works(platform, key) and await _works(platform, rotated.json()["key"])
    assert (await _listed(platform, tenant["id"]))[old_id]["status"] == "revoked"
