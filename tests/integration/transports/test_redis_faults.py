"""A worker rides out Redis faults: its connections cut (a Redis restart, a network blip) and Redis coming back
without the worker's stream, group and engine info (a restart without persistence). It keeps running, and the
platform serves again once Redis is back, without anyone restarting the worker."""

from __future__ import annotations

import asyncio
import secrets
from contextlib import suppress
from urllib.parse import urlsplit

import pytest
import redis.asyncio as redis

from pagewise.engine.async_engine import AsyncLLMEngine
from pagewise.platform.app import create_app
from pagewise.platform.keys.key_format import generate_key
from pagewise.platform.quotas.redis_store import RedisQuotaStore
from pagewise.platform.requests.store import RequestStore
from pagewise.platform.settings import Settings
from pagewise.protocol import RedisKeys
from pagewise.worker.host import EngineHost
from pagewise.worker.redis_worker import RedisWorker

from ..conftest import REDIS_URL
from ..harness import bearer, chat_body
from .conftest import with_admin

pytestmark = pytest.mark.anyio


class CuttableProxy:
    """A TCP forwarder to the tests' Redis (`REDIS_URL`). `cut()` closes every connection through it and refuses
    new ones until `restore()` — what a client sees while Redis restarts."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.port = 0
        self._open: set[asyncio.StreamWriter] = set()
        self._refusing = False

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing:
            writer.close()
            return
        upstream = urlsplit(REDIS_URL)
        up_reader, up_writer = await asyncio.open_connection(upstream.hostname, upstream.port or 6379)
        self._open.update((writer, up_writer))

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with suppress(ConnectionError, OSError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._open.difference_update((writer, up_writer))

    def cut(self) -> None:
        self._refusing = True
        for writer in list(self._open):
            writer.close()

    def restore(self) -> None:
        self._refusing = False

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


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


async def test_a_worker_survives_cut_connections_and_a_redis_that_lost_its_data(
    database_url: str, llm_engine: AsyncLLMEngine, redis_key_prefix: str
) -> None:
    keys = RedisKeys(redis_key_prefix)
    proxy = CuttableProxy()
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
        finally:
            worker.stop()
            await asyncio.wait_for(running, 60)
            await client.aclose()
            await proxy.close()
    await quotas.close()
