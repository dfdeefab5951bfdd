"""Every bad input gets its status and an OpenAI error body, and leaves no request row behind."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from pagewise.platform.db.models import RequestRecord
from pagewise.platform.inference.schemas import MAX_PROMPTS

from ..harness import MODEL, Platform, bearer, chat_body

pytestmark = pytest.mark.anyio


async def _rows(platform: Platform, tenant_id: str) -> int:
    async with platform.services.sessionmaker() as session:
        query = select(func.count()).select_from(RequestRecord).where(RequestRecord.tenant_id == tenant_id)
        return await session.scalar(query) or 0


def _assert_error(response, status: int, code: str | None = None, param: str | None = None) -> None:  # noqa: ANN001
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert isinstance(error["code"], str) and error["code"]  # never null: OpenAI's code, or ours
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "param"),
    [
        ("/v1/chat/completions", b"{not json", 400, "invalid_request", None),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, None, "messages"),
        ("/v1/chat/completions", {"model": MODEL}, 400, None, "messages"),
        ("/v1/chat/completions", chat_body(temperature="hot"), 400, None, "temperature"),
        ("/v1/chat/completions", chat_body(temperature=-1), 400, "invalid_request", None),
        ("/v1/chat/completions", chat_body(model="gpt-4o"), 404, "model_not_found", "model"),
        ("/v1/chat/completions", chat_body(content="hello " * 600), 400, "context_length_exceeded", None),
        ("/v1/chat/completions", chat_body(max_tokens=490), 400, "context_length_exceeded", None),
        ("/v1/chat/completions", chat_body(n=3), 400, None, "n"),
        ("/v1/chat/completions", chat_body(max_tokens=501), 400, "request_exceeds_limit", "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": []}, 400, None, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, "a"]}, 400, None, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, None, None),
        ("/v1/completions", {"model": MODEL, "prompt": ["a"] * (MAX_PROMPTS + 1)}, 400, None, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [[1]] * (MAX_PROMPTS + 1)}, 400, None, "prompt"),
    ],
)
async def test_rejected_with_openai_error_and_nothing_persisted(
    platform: Platform, path: str, body: dict | bytes, status: int, code: str | None, param: str | None
) -> None:
    tenant, key = await platform.tenant_with_key(max_n=2, max_tokens_per_request=500)
    headers = {**bearer(key), "Content-Type": "application/json"}
    if isinstance(body, bytes):
        response = await platform.http.post(path, content=body, headers=headers)
    else:
        response = await platform.http.post(path, json=body, headers=headers)
    _assert_error(response, status, code, param)
    assert await _rows(platform, tenant["id"]) == 0
    usage = await platform.services.quotas.usage(tenant["id"])
    assert (usage.concurrent, usage.requests_this_minute) == (0, 0)


async def test_body_over_the_limit_is_413(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key()
    huge = chat_body(content="x" * (platform.services.settings.max_body_bytes + 10))
    response = await platform.http.post("/v1/chat/completions", json=huge, headers=bearer(key))
    _assert_error(response, 413)
    assert await _rows(platform, tenant["id"]) == 0
