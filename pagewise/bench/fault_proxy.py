"""A TCP proxy whose connections a test can cut, to play a server restarting under its clients."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from contextlib import suppress


class CuttableProxy:
    """A TCP forwarder to `host:port` (the tests' Redis or PostgreSQL). `cut()` closes every connection through
    it and refuses new ones until `restore()` — what a client sees while that server restarts."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
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
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
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


class BackgroundProxy:
    """A `CuttableProxy` served by an event loop of its own in a daemon thread, for code that is not async (the
    processes of a stack connect through it while the caller starts them)."""

    def __init__(self, host: str, port: int) -> None:
        self._loop = asyncio.new_event_loop()
        self._proxy = CuttableProxy(host, port)
        threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._proxy.start(), self._loop).result(timeout=10)
        self.port = self._proxy.port

    def cut(self) -> None:
        """`CuttableProxy.cut`, done when this returns."""
        self._on_loop(self._proxy.cut)

    def restore(self) -> None:
        self._on_loop(self._proxy.restore)

    def _on_loop(self, call: Callable[[], None]) -> None:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._loop.call_soon_threadsafe(lambda: done.set_result(call()))
        done.result(timeout=10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._proxy.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
