"""A worker rides out Redis faults: its connections cut (a Redis restart, a network blip) and Redis coming back
without the worker's stream, group and engine info (a restart without persistence). It keeps running, and the
platform serves again once Redis is back, without anyone restarting the worker."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import redis.asyncio as redis

from pagewise.bench.fault_proxy import CuttableProxy
from pagewise.engine.async_engine import AsyncLLMEngine
from pagewise.platform.app import create_app
from pagewise.platform.keys.key_format import generate_key
from pagewise.platform.quotas.redis_store import RedisQuotaStore
from pagewise.platform.requests.store import RequestStore
from pagewise.platform.settings import Settings
from pagewise.serving.host import EngineHost
from pagewise.serving.protocol import ChoiceDelta, Delta, Event, Finished, RedisKeys, Usage, decode_event, encode
from pagewise.serving.settlement import Emit
from pagewise.worker.redis_worker import RedisWorker

from ..conftest import REDIS_URL
from ..harness import Platform, bearer, chat_body
from .conftest import STOP_TIMEOUT_S, _within, with_admin

pytestmark = pytest.mark.anyio


async def served_again(http, key: str, within_s: float) -> float:
    """Seconds until a chat request is answered 200 again (polling); fails after `within_s`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while loop.time() - start < within_s:
        response = await http.post("/v1/chat/completions", json=chat_body(), headers=bearer(key))
        if response.status_code == 200:
            return loop.time() - start
        assert response.status_code == 503, response.text  # never a 500 while the worker recovers
        await asyncio.sleep(0.2)
    raise AssertionError(f"not served again within {within_s} s")


async def running_on(worker: RedisWorker, request: Coroutine[Any, Any, httpx.Response]) -> tuple[asyncio.Task, str]:
    """Send `request` in a task; once the worker runs it, the task and the request's id (an execution of an
    earlier request may still be live for a moment after its answer)."""
    earlier = set(worker.host.live)
    answer = asyncio.create_task(request)
    loop = asyncio.get_running_loop()
    start = loop.time()
    while loop.time() - start < 30:
        if new := set(worker.host.live) - earlier:
            [request_id] = new
            return answer, request_id
        await asyncio.sleep(0.02)
    raise AssertionError("the worker never took the request")


async def long_request_running(platform: Platform, worker: RedisWorker) -> tuple[asyncio.Task, str]:
    """A new tenant's 400-token chat request (EOS ignored) in a task, once the worker runs it; and its id."""
    _, key = await platform.tenant_with_key()
    await served_again(platform.http, key, within_s=30)
    body = chat_body("Count to a thousand", max_tokens=400, ignore_eos=True)
    return await running_on(worker, platform.http.post("/v1/chat/completions", json=body, headers=bearer(key)))


@asynccontextmanager
async def worker_behind_proxy(
    database_url: str, llm_engine: AsyncLLMEngine, redis_key_prefix: str
) -> AsyncIterator[tuple[Platform, RedisWorker, asyncio.Task[None], CuttableProxy]]:
    """An API replica on the tests' Redis and one worker whose Redis connections all go through a `CuttableProxy`
    (heartbeat 0.2 s); the worker is stopped and waited for afterwards."""
    keys = RedisKeys(redis_key_prefix)
    upstream = urlsplit(REDIS_URL)
    proxy = CuttableProxy(upstream.hostname or "127.0.0.1", upstream.port or 6379)
    await proxy.start()
    settings = Settings.from_env(
        {},
        database_url=database_url,
        auto_migrate=False,
        admin_key=generate_key().key,
        redis_url=REDIS_URL,
        redis_key_prefix=redis_key_prefix,
        engine_mode="redis",
        worker_heartbeat_s=0.2,
    )
    quotas = RedisQuotaStore.from_url(REDIS_URL, redis_key_prefix)
    app = create_app(settings, quotas=quotas)
    async with app.lifespan():
        host = EngineHost(llm_engine, RequestStore(app.state.services.database), quotas)
        client = redis.Redis.from_url(f"redis://127.0.0.1:{proxy.port}/0")
        worker = RedisWorker(host, client, keys, worker_id=f"w-{secrets.token_hex(3)}", heartbeat_s=0.2)
        running = asyncio.get_running_loop().create_task(worker.run())
        try:
            async for platform in with_admin(app):
                yield platform, worker, running, proxy
        finally:
            worker.stop()
            await _within(running, STOP_TIMEOUT_S)  # past it: fails with every task's stack, never hangs
            await client.aclose()
            await proxy.close()
    await quotas.close()


async def test_a_worker_survives_cut_connections_and_a_redis_that_lost_its_data(
    database_url: str, llm_engine: AsyncLLMEngine, redis_key_prefix: str
) -> None:
    keys = RedisKeys(redis_key_prefix)
    async with worker_behind_proxy(database_url, llm_engine, redis_key_prefix) as (platform, worker, running, proxy):
        _, key = await platform.tenant_with_key()
        await served_again(platform.http, key, within_s=30)

        proxy.cut()  # every connection of the worker drops, and new ones are refused for a while
        await asyncio.sleep(1.5)
        assert not running.done()
        proxy.restore()
        await served_again(platform.http, key, within_s=30)

        direct = redis.Redis.from_url(REDIS_URL)  # Redis came back empty: stream, group, info gone
        await direct.delete(keys.submissions(worker.worker_id), keys.info(llm_engine.model_name))
        proxy.cut()
        proxy.restore()
        await direct.aclose()
        await served_again(platform.http, key, within_s=30)
        assert not running.done()


async def test_an_abort_published_while_the_subscription_is_down_still_cancels(
    database_url: str, llm_engine: AsyncLLMEngine, redis_key_prefix: str
) -> None:
    """The worker's abort subscription is dropped and the abort published before it is made again: nobody hears
    it, but the resubscribed worker finds its key and cancels the running request (it would run to the end)."""
    async with worker_behind_proxy(database_url, llm_engine, redis_key_prefix) as (platform, worker, _, proxy):
        answer, request_id = await long_request_running(platform, worker)
        direct = redis.Redis.from_url(REDIS_URL)
        await direct.client_kill_filter(_type="pubsub")  # the subscription drops; the worker waits ≥ 0.1 s
        await platform.app.state.services.engine.transport.abort(request_id)  # published to no one
        await direct.aclose()
        await asyncio.wait_for(answer, 60)
        final = await worker.host.requests.final_state(request_id)
        assert final is not None and final.status == "cancelled", final
        assert final.completion_tokens < 400


async def test_a_live_workers_submit_is_held_and_a_taken_over_one_is_fenced(
    database_url: str, llm_engine: AsyncLLMEngine, redis_key_prefix: str
) -> None:
    """While a worker runs a Submit its entry never looks idle for a TTL (each beat claims it again), so no
    adopter can take it. Once another consumer has claimed it — what an adopter does to a worker that stalled past
    the TTL — the holder's attempt stops without a word: no final row, no terminal event, no acknowledgement (the
    entry stays the adopter's)."""
    keys = RedisKeys(redis_key_prefix)
    async with worker_behind_proxy(database_url, llm_engine, redis_key_prefix) as (platform, worker, _, _):
        answer, request_id = await long_request_running(platform, worker)
        direct = redis.Redis.from_url(REDIS_URL)
        try:
            await asyncio.sleep(1.5)  # past the TTL (1 s): unheld, the entry would be idle long enough to adopt
            assert request_id in worker.host.live
            ttl_ms = int(5 * 0.2 * 1000)
            assert await direct.xpending_range(worker.inbox, RedisKeys.GROUP, "-", "+", 10, idle=ttl_ms) == []
            [entry] = await direct.xpending_range(worker.inbox, RedisKeys.GROUP, "-", "+", 10)
            entry_id = entry["message_id"]
            assert await direct.xclaim(worker.inbox, RedisKeys.GROUP, "adopter", 0, [entry_id], justid=True)
            loop = asyncio.get_running_loop()
            start = loop.time()
            while request_id in worker.host.live and loop.time() - start < 10:
                await asyncio.sleep(0.05)
            assert request_id not in worker.host.live  # stopped, long before its 400 tokens
            assert await worker.host.requests.final_state(request_id) is None
            [pending] = await direct.xpending_range(worker.inbox, RedisKeys.GROUP, entry_id, entry_id, 1)
            assert pending["consumer"] == b"adopter"
            events = [decode_event(fields[b"m"]) for _, fields in await direct.xrange(keys.events(request_id))]
            assert events and all(isinstance(e, Delta) for e in events)

            # the adopter's attempt 2 replays the tokens sent and adds one; a delta of the superseded attempt
            # arriving after that (a stalled worker before it learnt) is not what the reader gets
            sent = sum(len(c.token_ids) for e in events for c in e.choices)
            prompt_tokens = events[-1].prompt_tokens
            stream = keys.events(request_id)
            for event in (
                Delta(attempt=2, choices=[ChoiceDelta(0, "R", [1] * sent, None)], prompt_tokens=prompt_tokens,
                      cached_tokens=0),
                Delta(attempt=2, choices=[ChoiceDelta(0, "NEW", [2], "length")], prompt_tokens=prompt_tokens,
                      cached_tokens=0),
                Delta(attempt=1, choices=[ChoiceDelta(0, "STALE", [3], None)], prompt_tokens=prompt_tokens,
                      cached_tokens=0),
                Finished(attempt=2, status="completed",
                         usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=sent + 1), finished_at=time.time()),
            ):
                await direct.xadd(stream, {"m": encode(event)})
            response = await asyncio.wait_for(answer, 30)
            content = response.json()["choices"][0]["message"]["content"]
            assert content == "".join(c.text for e in events for c in e.choices) + "NEW"
        finally:
            answer.cancel()
            await asyncio.gather(answer, return_exceptions=True)
            await direct.aclose()


async def test_an_abort_arriving_while_its_submit_is_taken_is_applied(
    database_url: str, llm_engine: AsyncLLMEngine, redis_key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The abort is published after the worker checked the request's `aborted` key and before the execution
    exists (the subscription hears it, but nothing runs under that id yet): it is remembered and applied when the
    execution starts, so the request ends `cancelled` instead of running to its end."""
    async with worker_behind_proxy(database_url, llm_engine, redis_key_prefix) as (platform, worker, _, _):
        _, key = await platform.tenant_with_key()
        await served_again(platform.http, key, within_s=30)
        transport = platform.app.state.services.engine.transport
        check = worker._redis.exists
        aborted: list[str] = []

        async def exists_then_abort(*names: str) -> int:
            found = await check(*names)
            request_id = names[0].rsplit(":", 1)[-1]
            if not aborted and names[0].startswith(RedisKeys(redis_key_prefix).aborted("")):
                aborted.append(request_id)
                await transport.abort(request_id)
                await asyncio.sleep(0.3)  # the worker's subscription receives it meanwhile
            return found

        monkeypatch.setattr(worker._redis, "exists", exists_then_abort)
        body = chat_body("Count to a thousand", max_tokens=400, ignore_eos=True)
        answer = await platform.http.post("/v1/chat/completions", json=body, headers=bearer(key))
        assert answer.status_code == 200, answer.text
        [request_id] = aborted
        final = await worker.host.requests.final_state(request_id)
        assert final is not None and final.status == "cancelled", final
        assert final.completion_tokens < 400


async def test_a_stop_past_its_grace_leaves_the_request_for_adoption(
    database_url: str, llm_engine: AsyncLLMEngine, redis_key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker told to stop lets in-flight work run to its end for `STOP_GRACE_S`, and no longer: a request still
    running then is given up unfinished — no final row, its Submit pending and unacknowledged — so another worker
    adopts it; the stop itself returns promptly (an unbounded wait here once hung a CI run)."""
    monkeypatch.setattr("pagewise.worker.redis_worker.STOP_GRACE_S", 0.5)
    async with worker_behind_proxy(database_url, llm_engine, redis_key_prefix) as (platform, worker, running, _):
        answer, request_id = await long_request_running(platform, worker)
        direct = redis.Redis.from_url(REDIS_URL)
        try:
            loop = asyncio.get_running_loop()
            start = loop.time()
            worker.stop()
            await asyncio.wait_for(asyncio.shield(running), 30)
            assert loop.time() - start < 10  # the grace, then the cancellation: not the 400 tokens
            assert request_id not in worker.host.live
            assert await worker.host.requests.final_state(request_id) is None
            [pending] = await direct.xpending_range(worker.inbox, RedisKeys.GROUP, "-", "+", 10)
            assert pending["consumer"] == worker.worker_id.encode()
        finally:
            answer.cancel()
            await asyncio.gather(answer, return_exceptions=True)
            await direct.aclose()


async def test_a_request_that_swallows_its_cancellation_is_still_given_up_at_stop(
    database_url: str, llm_engine: AsyncLLMEngine, redis_key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancellation swallowed inside a Redis call (Python 3.11's timeouts can lose one; a CI run hung here) does
    not keep a stopping worker: the request's hold says no from then on, so it ends at its next delta — no row,
    its Submit pending for adoption."""
    monkeypatch.setattr("pagewise.worker.redis_worker.STOP_GRACE_S", 0.5)
    emitter = RedisWorker._emitter

    def deaf_emitter(self: RedisWorker, request_id: str) -> Emit:
        emit = emitter(self, request_id)

        async def emit_ignoring_cancellation(event: Event) -> None:
            try:
                await asyncio.sleep(0.2)  # a slow Redis: a cancellation lands here
                await emit(event)
            except asyncio.CancelledError:
                pass  # swallowed, as a Redis call under a racing timeout can

        return emit_ignoring_cancellation

    monkeypatch.setattr(RedisWorker, "_emitter", deaf_emitter)
    async with worker_behind_proxy(database_url, llm_engine, redis_key_prefix) as (platform, worker, running, _):
        answer, request_id = await long_request_running(platform, worker)
        direct = redis.Redis.from_url(REDIS_URL)
        try:
            loop = asyncio.get_running_loop()
            start = loop.time()
            worker.stop()
            await asyncio.wait_for(asyncio.shield(running), 30)
            assert loop.time() - start < 10
            assert await worker.host.requests.final_state(request_id) is None
            [pending] = await direct.xpending_range(worker.inbox, RedisKeys.GROUP, "-", "+", 10)
            assert pending["consumer"] == worker.worker_id.encode()
        finally:
            answer.cancel()
            await asyncio.gather(answer, return_exceptions=True)
            await direct.aclose()
