"""Listings run newest first on `(queued_at, id)`, whatever the id's prefix, and `after` is a keyset cursor."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from ..harness import MODEL, Platform, bearer
from .rows import request_row

pytestmark = pytest.mark.anyio


async def _all_pages(platform: Platform, path: str, key: str, **params: Any) -> list[list[str]]:
    """The ids of every page, following `last_id` while `has_more`."""
    pages: list[list[str]] = []
    while True:
        page = (await platform.http.get(path, params=params, headers=bearer(key))).json()
        pages.append([r["id"] for r in page["data"]])
        if not page["has_more"]:
            return pages
        params["after"] = page["last_id"]


async def test_interleaved_chat_and_completions_page_newest_first(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key()
    created = []
    for i in range(6):
        if i % 2:
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
            response = await platform.http.post("/v1/completions", json=body, headers=bearer(key))
        else:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
            response = await platform.http.post("/v1/chat/completions", json=body, headers=bearer(key))
        created.append(response.json()["id"])
    newest_first = created[::-1]
    assert {i.split("-")[0] for i in created} == {"chatcmpl", "cmpl"}  # OpenAI's id shapes
    pages = await _all_pages(platform, "/v1/requests", key, limit=4)
    assert pages == [newest_first[:4], newest_first[4:]]
    admin_pages = await _all_pages(platform, "/admin/requests", platform.admin_key, tenant_id=tenant["id"], limit=4)
    assert admin_pages == pages


async def test_equal_queued_at_breaks_ties_by_id(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key()
    moment = dt.datetime(2001, 1, 1, tzinfo=dt.UTC)
    endpoints = ("completions", "chat.completions") * 2
    rows = [request_row(tenant["id"], endpoint, moment, status="completed") for endpoint in endpoints]
    older = request_row(tenant["id"], "completions", moment - dt.timedelta(microseconds=1), status="completed")
    for row in (*rows, older):
        await platform.services.requests.create(row)
    expected = sorted((r.id for r in rows), reverse=True) + [older.id]
    pages = await _all_pages(platform, "/v1/requests", key, limit=2)
    assert pages == [expected[:2], expected[2:4], expected[4:]]


async def test_a_cursor_outside_the_callers_rows_is_a_400(platform: Platform) -> None:
    mine, key = await platform.tenant_with_key()
    other, _ = await platform.tenant_with_key()
    foreign = request_row(other["id"], "completions", dt.datetime.now(dt.UTC), status="completed")
    await platform.services.requests.create(foreign)
    for path, caller, after in (
        ("/v1/requests", key, "cmpl_unknown"),
        ("/v1/requests", key, foreign.id),
        ("/admin/requests", platform.admin_key, "cmpl_unknown"),
    ):
        response = await platform.http.get(path, params={"after": after}, headers=bearer(caller))
        assert response.status_code == 400, (path, after, response.text)
        assert response.json()["error"]["param"] == "after"
    admin = await platform.http.get(
        "/admin/requests", params={"after": foreign.id, "tenant_id": mine["id"]}, headers=bearer(platform.admin_key)
    )
    assert admin.status_code == 200 and admin.json()["data"] == []
