"""The Litestar app factory: routes registered in one place, services built in the lifespan."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from typing import TYPE_CHECKING

import anyio
from litestar import Litestar
from litestar.di import Provide
from litestar.middleware import DefineMiddleware

from pagewise import tracing
from pagewise.platform.adapters.controllers import AdapterController, AdminAdapterController
from pagewise.platform.admin.controllers import AdminController
from pagewise.platform.admin.workers import list_workers
from pagewise.platform.batches.controllers import BatchController
from pagewise.platform.batches.runner import keep_running_batches
from pagewise.platform.billing.controllers import PriceController
from pagewise.platform.billing.exports import ExportController
from pagewise.platform.dashboard import DASHBOARD_HANDLERS, template_config
from pagewise.platform.db.database import Database
from pagewise.platform.db.migrate import upgrade_head
from pagewise.platform.db.session import create_db_engine, provide_db_session
from pagewise.platform.engine_client import EngineClient, Transport
from pagewise.platform.engine_loader import engine_summary, load_engine
from pagewise.platform.errors import EXCEPTION_HANDLERS
from pagewise.platform.files.controllers import FileController
from pagewise.platform.http_edge import add_security_headers, refuse_nul_bytes
from pagewise.platform.inference.controllers import InferenceController
from pagewise.platform.inference.leases import keep_sweeping
from pagewise.platform.keys.auth import UNGUARDED_PATHS, ApiKeyAuthMiddleware
from pagewise.platform.keys.controllers import KeyController
from pagewise.platform.keys.service import KeyService
from pagewise.platform.openapi import describe_errors, openapi_config
from pagewise.platform.paths import admin_key_file
from pagewise.platform.quotas.ledger import DatabaseLedger
from pagewise.platform.quotas.memory_store import InProcessQuotaStore
from pagewise.platform.quotas.quota_store import MonthLedger, QuotaStore
from pagewise.platform.quotas.redis_store import RedisQuotaStore
from pagewise.platform.requests.controllers import RequestController
from pagewise.platform.requests.store import RequestStore
from pagewise.platform.services import PlatformServices, provide_services
from pagewise.platform.settings import Settings
from pagewise.platform.system import health, metrics, ready
from pagewise.platform.telemetry import PlatformMetrics
from pagewise.platform.tenants.controllers import TenantController
from pagewise.platform.tracing import (
    TracedApiKeyAuthMiddleware,
    add_trace_id_header,
    server_span_plugin,
    traced_database,
    traced_quotas,
)
from pagewise.platform.usage.controllers import UsageController

if TYPE_CHECKING:  # only the embedded mode loads an engine; importing this module loads no torch
    from pagewise.engine.async_engine import AsyncLLMEngine

logger = logging.getLogger("pagewise.platform")


async def build_transport(
    settings: Settings,
    engine: AsyncLLMEngine | None,
    requests: RequestStore,
    quotas: QuotaStore,
    metrics: PlatformMetrics,
    on_engine_dead: Callable[[], None] | None,
) -> Transport:
    """Redis Streams to workers (`engine_mode=redis`), or an engine in this process behind the loopback."""
    if settings.engine_mode == "redis":
        from pagewise.platform.transports.redis import RedisTransport

        return RedisTransport.from_url(
            settings.redis_url,
            settings.redis_key_prefix,
            settings.engine.listed_model_name,
            heartbeat_ttl_s=settings.heartbeat_ttl_s,
            max_queue_depth=settings.max_queue_depth,
            affinity=settings.routing_affinity,
        )
    from pagewise.platform.transports.loopback import LoopbackTransport
    from pagewise.serving.adapter_store import AdapterStore
    from pagewise.serving.host import EngineHost

    owned = engine is None
    if engine is None:
        engine = await anyio.to_thread.run_sync(load_engine, settings, on_engine_dead)
        logger.info("%s", engine_summary(engine))
    host = EngineHost(engine, requests, quotas, metrics, adapters=AdapterStore(settings.adapters_path))
    return LoopbackTransport(host, owns_engine=owned)


def build_quota_store(settings: Settings, ledger: MonthLedger) -> QuotaStore:
    """Shared by every replica in Redis when there is one; in this process otherwise. Monthly counters start
    from `ledger` (the database)."""
    if settings.redis_url:
        return RedisQuotaStore.from_url(
            settings.redis_url, settings.redis_key_prefix, lease_s=settings.quota_lease_s, ledger=ledger
        )
    return InProcessQuotaStore(lease_s=settings.quota_lease_s, ledger=ledger)


def announce_admin_key(key: str, database_url: str) -> None:
    """Show a generated admin key once: on the controlling terminal, never in a log stream.

    Without a terminal (a container, a supervisor), the key goes to a file only its owner can read and the log
    names the file. `PAGEWISE_ADMIN_KEY` avoids both: the operator chooses the key.
    """
    notice = (
        "\n  pagewise: first start on an empty database — created tenant 'admin' and an admin API key:\n\n"
        f"      {key}\n\n"
        "  It is shown only this once (set PAGEWISE_ADMIN_KEY to choose it yourself). Create a tenant and a key:\n"
        "      pagewise tenants create acme && pagewise keys create --tenant acme\n"
        '  or over HTTP: POST /admin/tenants {"name": "acme"}, then POST /admin/tenants/<id>/keys {}\n\n'
    )
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(notice)
        return
    except OSError:
        pass
    path = admin_key_file(database_url)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(key + "\n")
    logger.warning("first start: created an admin API key; no terminal to show it on, so it is in %s", path)


ROUTE_HANDLERS = [
    health,
    ready,
    metrics,
    InferenceController,
    RequestController,
    FileController,
    AdapterController,
    AdminAdapterController,
    BatchController,
    UsageController,
    TenantController,
    KeyController,
    AdminController,
    list_workers,
    PriceController,
    ExportController,
    *DASHBOARD_HANDLERS,
]


async def _before_serving(services: PlatformServices) -> None:
    """An embedded server fails the requests its previous run left unfinished; any server makes sure an admin key
    exists (announcing a generated one)."""
    settings = services.settings
    if settings.is_embedded:
        interrupted = await services.requests.fail_unfinished()
        if interrupted:
            logger.warning("marked %d requests left unfinished by a previous run as failed", interrupted)
    async with services.sessionmaker() as session:
        created = await KeyService(session).bootstrap_admin(settings.admin_key)
    if created is not None and settings.admin_key is None:
        announce_admin_key(created.key, settings.database_url)
    elif created is not None:
        logger.info("first start: stored the admin key given in PAGEWISE_ADMIN_KEY")


def _lifespan(
    settings: Settings,
    engine: AsyncLLMEngine | None,
    quotas: QuotaStore | None,
    on_engine_dead: Callable[[], None] | None,
) -> Callable[[Litestar], AbstractAsyncContextManager[None]]:
    """What the app does around serving: migrate (if asked), build its services and transport, start them, and
    take them down in reverse order."""

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        if settings.auto_migrate:
            await anyio.to_thread.run_sync(upgrade_head, settings.database_url)
        database = Database(create_db_engine(settings.database_url))
        with traced_database(database):
            sessionmaker = database.sessionmaker
            store = traced_quotas(quotas or build_quota_store(settings, DatabaseLedger(database)))
            requests = RequestStore(database)
            metrics = PlatformMetrics(lambda: transport.stats(), settings.engine.listed_model_name)
            transport = await build_transport(settings, engine, requests, store, metrics, on_engine_dead)
            services = PlatformServices(settings, EngineClient(transport), store, database, requests, metrics)
            app.state.services, app.state.sessionmaker = services, sessionmaker
            await _before_serving(services)
            await transport.start()
            loop = asyncio.get_running_loop()
            background = [
                loop.create_task(keep_sweeping(requests, settings.quota_lease_s / 3)),
                loop.create_task(keep_running_batches(services)),
            ]
            try:
                yield
            finally:
                for task in background:
                    task.cancel()
                    with suppress(asyncio.CancelledError):
                        await task
                await transport.close()
                if quotas is None:
                    await store.close()
                await database.dispose()

    return lifespan


def create_app(
    settings: Settings | None = None,
    *,
    engine: AsyncLLMEngine | None = None,
    quotas: QuotaStore | None = None,
    on_engine_dead: Callable[[], None] | None = None,
) -> Litestar:
    """The service. `engine` (an in-process engine) and `quotas` may be passed in (tests); otherwise they are
    built from settings.

    A passed-in engine is started but not shut down by the app; one the app loads itself is both, and
    `on_engine_dead` is called if that engine's loop dies. In `redis` engine mode no engine is loaded.
    """
    settings = settings or Settings.from_env()
    traced = tracing.configure_from_env("pagewise-api")

    lifespan = _lifespan(settings, engine, quotas, on_engine_dead)

    return Litestar(
        route_handlers=ROUTE_HANDLERS,
        dependencies={
            "services": Provide(provide_services, sync_to_thread=False),
            "db_session": Provide(provide_db_session),
        },
        middleware=[
            refuse_nul_bytes,
            DefineMiddleware(
                TracedApiKeyAuthMiddleware if traced else ApiKeyAuthMiddleware,
                exclude=[f"^{p}" for p in UNGUARDED_PATHS],
            ),
        ],
        before_send=[add_security_headers, *([add_trace_id_header] if traced else [])],
        plugins=[server_span_plugin()] if traced else [],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=[lifespan],
        request_max_body_size=settings.max_body_bytes,
        openapi_config=openapi_config(),
        template_config=template_config(),
        on_startup=[describe_errors],
    )
