"""Tenant limits count what a request really asks the engine for, and say which limit refused it.

- A completions `prompt` list runs `len(prompts) x n` sequences: they count against `max_n`, take that many
  concurrency slots and reserve every prompt's tokens plus `n x max_tokens` each.
- Without `max_tokens`, admission reserves what the request can really use: bounded by the context window and
  by the tenant's token limits, so a small tokens-per-minute limit never produces a 429 that cannot succeed.
- A request that could never fit a limit is a 400 (not retryable), naming the limit.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import func, select

from pagewise.platform.db.models import RequestRecord

from ..harness import MODEL, Platform, bearer, chat_body

pytestmark = pytest.mark.anyio


async def _rows(platform: Platform, tenant_id: str) -> int:
    async with platform.services.sessionmaker() as session:
        query = select(func.count()).select_from(RequestRecord).where(RequestRecord.tenant_id == tenant_id)
        return await session.scalar(query) or 0


def _prompts(count: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [f"Prompt number {i}" for i in range(count)], "max_tokens": 2, **extra}


async def test_prompt_list_times_n_counts_against_max_n(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key(max_n=4)
    for body in (_prompts(5), _prompts(3, n=2), _prompts(300)):
        response = await platform.http.post("/v1/completions", json=body, headers=bearer(key))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt"
    ok = await platform.http.post("/v1/completions", json=_prompts(2, n=2), headers=bearer(key))
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"]) == 4
    assert await _rows(platform, tenant["id"]) == 1


async def test_prompt_list_takes_a_slot_per_sequence(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key(max_concurrent_requests=2, max_n=None)
    never = await platform.http.post("/v1/completions", json=_prompts(3), headers=bearer(key))
    assert never.status_code == 400, never.text
    assert never.json()["error"]["code"] == "request_exceeds_limit"
    # one long request holds one slot; a 2-prompt request then needs 2 and must wait (429), a 1-prompt one fits
    long = asyncio.create_task(
        platform.http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 64, "ignore_eos": True},
            headers=bearer(key),
        )
    )
    for _ in range(200):
        if (await platform.services.quotas.usage(tenant["id"])).concurrent == 1:
            break
        await asyncio.sleep(0.01)
    busy = await platform.http.post("/v1/completions", json=_prompts(2), headers=bearer(key))
    assert busy.status_code == 429, busy.text
    assert "concurrency" in busy.json()["error"]["message"].lower()
    fits = await platform.http.post("/v1/completions", json=_prompts(1), headers=bearer(key))
    assert fits.status_code == 200, fits.text
    assert (await long).status_code == 200
    assert (await platform.services.quotas.usage(tenant["id"])).concurrent == 0


async def test_prompt_list_reserves_every_prompt(platform: Platform) -> None:
    engine = platform.services.engine
    prompts = [f"Prompt number {i}" for i in range(3)]
    need = sum(len(engine.encode(p)) for p in prompts) + 3 * 2 * 5  # n=2, max_tokens=5
    tenant, key = await platform.tenant_with_key(tokens_per_minute=need - 1, max_n=None)
    body = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 5}
    refused = await platform.http.post("/v1/completions", json=body, headers=bearer(key))
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "request_exceeds_limit"
    assert await _rows(platform, tenant["id"]) == 0


async def test_default_max_tokens_fits_a_small_token_limit(platform: Platform) -> None:
    """With TPM 120 and no max_tokens, the request is admitted (its output bounded to fit), not a 429 forever."""
    tenant, key = await platform.tenant_with_key(tokens_per_minute=120)
    body = chat_body()
    del body["max_tokens"]
    response = await platform.http.post("/v1/chat/completions", json={**body, "ignore_eos": True}, headers=bearer(key))
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["total_tokens"] == 120  # the prompt plus every output token the limit allowed
    quota = await platform.services.quotas.usage(tenant["id"])
    assert quota.tokens_this_minute == 120


async def test_prompt_alone_over_the_token_limit_is_400(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key(tokens_per_minute=20)
    body = chat_body(content="word " * 40)
    del body["max_tokens"]
    response = await platform.http.post("/v1/chat/completions", json=body, headers=bearer(key))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "request_exceeds_limit" and "tokens_per_minute" in error["message"]
    explicit = await platform.http.post(
        "/v1/chat/completions", json=chat_body(max_tokens=100), headers=bearer(key)
    )
    assert explicit.status_code == 400, explicit.text
    assert explicit.json()["error"]["code"] == "request_exceeds_limit"
    assert await _rows(platform, tenant["id"]) == 0


async def test_429_names_the_limit_and_what_remains(platform: Platform) -> None:
    _, key = await platform.tenant_with_key(tokens_per_minute=100)
    first = await platform.http.post("/v1/chat/completions", json=chat_body(max_tokens=60), headers=bearer(key))
    assert first.status_code == 200, first.text
    second = await platform.http.post("/v1/chat/completions", json=chat_body(max_tokens=60), headers=bearer(key))
    assert second.status_code == 429, second.text
    message = second.json()["error"]["message"]
    assert "tokens per minute" in message and "remaining" in message
    assert int(second.headers["retry-after"]) >= 1


async def test_a_tenant_at_its_limit_is_refused_before_tokenizing(
    platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cheap limits first: a flood of large prompts from a tenant at its request rate costs a counter read each."""
    _, key = await platform.tenant_with_key(requests_per_minute=1)
    first = await platform.http.post("/v1/completions", json=_prompts(1), headers=bearer(key))
    assert first.status_code == 200, first.text
    encoded: list[int] = []
    real_encode = platform.services.engine.encode
    monkeypatch.setattr(platform.services.engine, "encode", lambda text: encoded.append(len(text)) or real_encode(text))
    huge = {"model": MODEL, "prompt": "word " * 150_000, "max_tokens": 2}
    refused = await platform.http.post("/v1/completions", json=huge, headers=bearer(key))
    assert refused.status_code == 429, refused.text
    assert "requests per minute" in refused.json()["error"]["message"]
    assert encoded == []
