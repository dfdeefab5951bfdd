"""A worker whose quotas live in its Redis settles in one transaction: the reconcile, then the terminal event."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as redis

from pagewise.engine.async_engine import AsyncLLMEngine
from pagewise.platform.quotas.memory_store import InProcessQuotaStore
from pagewise.platform.quotas.quota_store import QuotaLimits
from pagewise.platform.quotas.redis_store import RedisQuotaStore
from pagewise.platform.tracing import TracedQuotaStore
from pagewise.serving.host import EngineHost
from pagewise.serving.protocol import Finished, RedisKeys, Usage, decode_event
from pagewise.worker.redis_worker import RedisWorker

from ..conftest import REDIS_URL

pytestmark = pytest.mark.anyio
LIMITS = QuotaLimits(max_concurrent_requests=1)


def _finished(tokens: int) -> Finished:
    usage = Usage(prompt_tokens=3, completion_tokens=tokens - 3)
    return Finished(attempt=1, status="completed", usage=usage, finished_at=time.time())


async def test_the_reconcile_and_the_terminal_event_go_in_one_transaction(
    llm_engine: AsyncLLMEngine, redis_key_prefix: str
) -> None:
    store = RedisQuotaStore.from_url(REDIS_URL, redis_key_prefix)
    client = redis.Redis.from_url(REDIS_URL)
    keys = RedisKeys(redis_key_prefix)
    try:
        worker = RedisWorker(EngineHost(llm_engine, None, TracedQuotaStore(store)), client, keys, worker_id="w")
        settle = worker._settler("cmpl_settled")
        assert settle is not None  # found under the tracing wrapper
        decision = await store.reserve("t-settle", LIMITS, 20, "cmpl_settled")
        assert decision.reservation is not None
        assert (await store.reserve("t-settle", LIMITS, 20, "cmpl_next")).rejected_by == "concurrency"

        event = _finished(7)
        await settle(decision.reservation, 7, None, event)
        entries = await client.xrange(keys.events("cmpl_settled"))
        assert [decode_event(fields[b"m"]) for _, fields in entries] == [event]
        usage = await store.usage("t-settle")
        assert usage.concurrent == 0 and usage.tokens_this_minute == 7  # the slot is free, the tokens settled
        assert (await store.reserve("t-settle", LIMITS, 20, "cmpl_next")).reservation is not None

        await settle(decision.reservation, 99, None, _finished(99))  # a second settlement changes no counter
        assert (await store.usage("t-settle")).tokens_this_minute == 7 + 20
        assert len(await client.xrange(keys.events("cmpl_settled"))) == 2
    finally:
        await client.aclose()
        await store.close()


async def test_quotas_elsewhere_settle_in_two_steps(llm_engine: AsyncLLMEngine, redis_key_prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        host = EngineHost(llm_engine, None, InProcessQuotaStore())
        assert RedisWorker(host, client, RedisKeys(redis_key_prefix), worker_id="w")._settler("r") is None
    finally:
        await client.aclose()
