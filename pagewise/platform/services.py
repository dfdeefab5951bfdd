"""The services a route may depend on, built once per app and handed out by dependency injection."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from dataclasses import dataclass, field
from typing import TypeAlias

from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.params import SkipValidation
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from pagewise.platform.db.database import Database
from pagewise.platform.engine_client import EngineClient
from pagewise.platform.keys.auth_throttle import FailedAuthThrottle
from pagewise.platform.quotas.quota_store import QuotaStore
from pagewise.platform.requests.store import RequestStore
from pagewise.platform.settings import Settings
from pagewise.platform.telemetry import PlatformMetrics


@dataclass(slots=True)
class PlatformServices:
    """Long-lived parts of one app. The engines (in process or in workers) own running requests; the API keeps
    no per-request state beyond a reader's."""

    settings: Settings
    engine: EngineClient
    quotas: QuotaStore
    database: Database
    requests: RequestStore
    metrics: PlatformMetrics
    auth_failures: FailedAuthThrottle = field(default_factory=FailedAuthThrottle)
    started_at: int = field(default_factory=lambda: int(time.time()))
    batch_created: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when this process creates a batch: wakes the idle batch runner (`batches/runner.py`)."""

    @property
    def sessionmaker(self) -> async_sessionmaker[AsyncSession]:
        return self.database.sessionmaker

    def lease_expiry(self) -> dt.datetime:
        """When a row admitted now stops being claimed, unless the engine that takes it renews its lease."""
        return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=self.quotas.lease_s)


Services: TypeAlias = NamedDependency[SkipValidation[PlatformServices]]
"""How a handler asks for the services: injected by name, passed through as is (never converted)."""


def provide_services(state: State) -> PlatformServices:
    return state.services
