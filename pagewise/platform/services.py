"""The services a route may depend on, built once per app and handed out by dependency injection."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.params import SkipValidation
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from pagewise.platform.engine_client import EngineClient
from pagewise.platform.quotas.quota_store import QuotaStore
from pagewise.platform.requests.store import RequestStore
from pagewise.platform.settings import Settings
from pagewise.platform.telemetry import PlatformMetrics

if TYPE_CHECKING:
    from pagewise.platform.inference.job import InferenceJob


@dataclass(slots=True)
class PlatformServices:
    """Long-lived parts of one app. `live` maps every admitted, not yet settled request's id to its job;
    `running` the async requests among them while their task runs."""

    settings: Settings
    engine: EngineClient
    quotas: QuotaStore
    sessionmaker: async_sessionmaker[AsyncSession]
    requests: RequestStore
    metrics: PlatformMetrics
    started_at: int = field(default_factory=lambda: int(time.time()))
    live: dict[str, InferenceJob] = field(default_factory=dict)
    running: dict[str, InferenceJob] = field(default_factory=dict)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    def lease_expiry(self) -> dt.datetime:
        """When a row admitted or renewed now stops being this process's, unless renewed again."""
        return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=self.quotas.lease_s)

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `coroutine` in the background, holding a reference until it ends (shutdown awaits it)."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self) -> None:
        """Cancel async requests, then wait for every background task (finishing writes included)."""
        await asyncio.gather(*(job.cancel() for job in list(self.running.values())), return_exceptions=True)
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


Services: TypeAlias = NamedDependency[SkipValidation[PlatformServices]]
"""How a handler asks for the services: injected by name, passed through as is (never converted)."""


def provide_services(state: State) -> PlatformServices:
    return state.services
