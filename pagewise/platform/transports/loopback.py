"""The embedded mode's transport: the engine runs in this process, behind the same protocol messages.

Each request's events are kept in memory from its first to `RETAIN_S` seconds after its terminal event, so a
second reader (a reconnecting client, `DELETE` waiting for the end) replays them exactly as a Redis reader would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagewise import tracing
from pagewise.engine.tokenizer import Tokenizer
from pagewise.serving.host import EngineHost
from pagewise.serving.protocol import EngineInfo, Event, Finished, Rejected, Submit, WorkerHeartbeat

RETAIN_S = 60.0
TERMINAL = (Finished, Rejected)


@dataclass(slots=True)
class _Log:
    events: list[Event] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def ended(self) -> bool:
        return bool(self.events) and isinstance(self.events[-1], TERMINAL)


class LoopbackTransport:
    def __init__(self, host: EngineHost, *, owns_engine: bool) -> None:
        self.host = host
        self._owns_engine = owns_engine
        self._info = host.engine_info(with_tokenizer=False)  # in process, the tokenizer object itself is shared
        self._logs: dict[str, _Log] = {}
        self._started_at = 0.0

    def engine_info(self) -> EngineInfo:
        return self._info

    def tokenizer(self) -> Tokenizer:
        return self.host.engine.tokenizer

    async def start(self) -> None:
        self._started_at = asyncio.get_running_loop().time()
        self.host.start()

    async def close(self) -> None:
        await self.host.drain()
        if self._owns_engine:
            self.host.engine.shutdown()

    def check_capacity(self, tenant_id: str) -> None:
        """The engine queues whatever it is given; quotas and the KV-cache check bound what that is."""

    async def submit(self, submit: Submit) -> None:
        log = self._logs.setdefault(submit.request_id, _Log())

        async def emit(event: Event) -> None:
            log.events.append(event)
            log.changed.set()
            if isinstance(event, TERMINAL):
                asyncio.get_running_loop().call_later(RETAIN_S, self._logs.pop, submit.request_id, None)

        with tracing.enqueue_span(submit, "pagewise.loopback", "engine") as traced:
            self.host.run(traced, emit)

    async def events(self, request_id: str) -> AsyncIterator[Event]:
        log = self._logs.get(request_id)
        if log is None:
            return
        seen = 0
        while True:
            while seen < len(log.events):
                event = log.events[seen]
                seen += 1
                yield event
                if isinstance(event, TERMINAL):
                    return
            log.changed.clear()
            if seen < len(log.events):
                continue
            await log.changed.wait()

    async def abort(self, request_id: str) -> None:
        self.host.abort(request_id)

    def stats(self) -> dict[str, Any]:
        return self.host.stats()

    def workers(self) -> list[WorkerHeartbeat]:
        """This process's engine, reported like a worker."""
        return [self.host.heartbeat("embedded", self._info.model)]

    def error(self) -> BaseException | None:
        return self.host.engine.error
