"""A NUL inside any JSON value is a 400 naming the field on both databases — never a 500 from PostgreSQL, which
stores no NUL in text or JSON — and nothing is written."""

from __future__ import annotations

import pytest

from .harness import MODEL, Platform, bearer

pytestmark = pytest.mark.anyio


async def test_nul_in_json_ids_and_prompts_is_a_400(platform: Platform) -> None:
    admin = bearer(platform.admin_key)
    export = await platform.http.post("/admin/exports", json={"tenant_id": "a\u0000b", "period": "2026-11"},
                                      headers=admin)
    assert export.status_code == 400, export.text
    assert export.json()["error"]["param"] == "tenant_id" and "U+0000" in export.json()["error"]["message"]
    _, key = await platform.tenant_with_key()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi\u0000there"}], "max_tokens": 2}
    chat = await platform.http.post("/v1/chat/completions", json=body, headers=bearer(key))
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages[0].content", chat.text
    assert (await platform.http.get("/v1/requests", headers=bearer(key))).json()["data"] == []
