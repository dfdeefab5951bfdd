"""Billed tokens are what the engine computed, whenever and however a streamed client hangs up.

For many disconnect points — right after the headers, after k events — the request's row, its usage and the
tenant's quota all carry exactly the prompt and generated tokens the engine's own counters grew by, including
tokens generated after the client left and before the engine saw the abort.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from litestar.types import Message
from sqlalchemy import select

from pagewise.platform.db.models import RequestRecord

from ..harness import MODEL, Platform, asgi_scope

pytestmark = pytest.mark.anyio

DISCONNECT_POINTS = sorted({0, 1, 2, 3, 5, 8, 13, *random.Random(13).sample(range(4, 40), 5)})
MAX_TOKENS = 24  # fewer events than the largest points: those requests complete before the hang-up


async def _stream_and_hang_up(platform: Platform, key: str, prompt: str, after_events: int) -> None:
    """One streamed completion whose client disconnects after `after_events` body events (0: after headers)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    gone = asyncio.Event()
    state = {"body_sent": False, "events": 0}

    async def receive() -> Message:
        if not state["body_sent"]:
            state["body_sent"] = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start" and after_events == 0:
            gone.set()
        if message["type"] == "http.response.body" and message.get("body"):
            state["events"] += 1
            if state["events"] >= after_events:
                gone.set()

    await asyncio.wait_for(platform.app(asgi_scope("/v1/completions", key), receive, send), timeout=120)


async def _engine_counters(platform: Platform) -> tuple[int, int]:
    """(prompt, generation) token counters once the engine is idle again."""
    engine = platform.services.engine
    for _ in range(400):
        stats = engine.stats()
        if stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0:
            return int(stats["prompt_tokens_total"]), int(stats["generation_tokens_total"])
        await asyncio.sleep(0.025)
    raise AssertionError(f"the engine did not go idle: {engine.stats()}")


async def test_billed_tokens_equal_the_engines_counters_at_every_disconnect_point(platform: Platform) -> None:
    tenant, key = await platform.tenant_with_key()
    billed_total = 0
    for point, prompt in zip(DISCONNECT_POINTS, _prompts(len(DISCONNECT_POINTS)), strict=True):
        prompt_before, generated_before = await _engine_counters(platform)
        await _stream_and_hang_up(platform, key, prompt, point)
        prompt_after, generated_after = await _engine_counters(platform)
        async with platform.services.sessionmaker() as session:
            row = await session.scalar(
                select(RequestRecord)
                .where(RequestRecord.tenant_id == tenant["id"])
                .order_by(RequestRecord.queued_at.desc(), RequestRecord.id.desc())
            )
        assert row is not None and row.status in ("cancelled", "completed"), (point, row and row.status)
        assert (row.prompt_tokens, row.completion_tokens) == (
            prompt_after - prompt_before,
            generated_after - generated_before,
        ), f"disconnect after {point} events"
        if row.status == "completed":
            assert row.completion_tokens == MAX_TOKENS
        billed_total += row.prompt_tokens + row.completion_tokens
        quota = await platform.services.quotas.usage(tenant["id"])
        assert quota.concurrent == 0 and quota.tokens_this_minute == billed_total


def _prompts(count: int) -> list[str]:
    """Distinct prompts (no prefix-cache hit between them), some long enough that the prefill takes a while."""
    rng = random.Random(7)
    words = ["paged", "attention", "blocks", "tenants", "billing", "tokens", "stream", "engine"]
    return [" ".join(rng.choice(words) for _ in range(rng.choice((8, 120, 300)))) + f" #{i}" for i in range(count)]
