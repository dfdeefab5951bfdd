"""`pagewise worker`: an engine worker of the distributed mode (see `pagewise.worker.redis_worker`).

Reads `PAGEWISE_DATABASE_URL`, `PAGEWISE_REDIS_URL` (required), `PAGEWISE_REDIS_KEY_PREFIX`, the lease and
heartbeat settings, and the engine flags (which win over `PAGEWISE_*` engine variables). Exit status: 0 after
SIGTERM/SIGINT (in-flight requests run to their end first), 2 when it cannot start, 3 when its engine died.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from pagewise import event_loop
from pagewise.exit_status import ExitStatus
from pagewise.platform.cli import add_database_url_argument
from pagewise.structured_logs import configure_logging

logger = logging.getLogger("pagewise.worker")


def register(subparsers: argparse._SubParsersAction, add_engine_arguments: Callable[[Any], None]) -> None:
    worker = subparsers.add_parser("worker", help="run an engine worker that serves requests from Redis Streams")
    worker.add_argument("--worker-id", help="a stable name for this worker (default: <host>-<random>)")
    worker.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (default: none)")
    worker.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="the metrics port's address (default: 127.0.0.1); any other needs PAGEWISE_METRICS_TOKEN, which "
        "every scrape must then send as a bearer token",
    )
    add_database_url_argument(worker)
    add_engine_arguments(worker)
    worker.set_defaults(func=worker_command)


def worker_command(args: argparse.Namespace) -> int:
    from pagewise.engine.config import EngineConfig
    from pagewise.platform.db.session import DatabaseUnreachableError, check_database
    from pagewise.platform.redis_check import RedisUnreachableError, check_redis
    from pagewise.platform.settings import Settings, SettingsError
    from pagewise.worker.metrics_server import MetricsExposureError, check_exposure

    configure_logging()
    engine_flags = {f.name: getattr(args, f.name, None) for f in fields(EngineConfig)}
    try:
        settings = Settings.from_env(engine=engine_flags, database_url=args.database_url)
        if settings.redis_url is None:
            raise SettingsError("pagewise worker needs PAGEWISE_REDIS_URL (the Redis its API replicas use)")
        if args.metrics_port is not None:
            check_exposure(args.metrics_host, settings.metrics_token)
        asyncio.run(check_database(settings.database_url))
        asyncio.run(check_redis(settings.redis_url))
    except (SettingsError, MetricsExposureError, DatabaseUnreachableError, RedisUnreachableError) as error:
        print(f"error: {error}", file=sys.stderr)
        return ExitStatus.STARTUP_ERROR
    return event_loop.run(_serve(settings, args))


async def _serve(settings: Any, args: argparse.Namespace) -> int:
    import anyio
    import redis.asyncio as redis

    from pagewise.platform.db.database import Database
    from pagewise.platform.db.session import create_db_engine
    from pagewise.platform.engine_loader import engine_summary, load_engine
    from pagewise.platform.quotas.redis_store import RedisQuotaStore
    from pagewise.platform.requests.store import RequestStore
    from pagewise.platform.telemetry import PlatformMetrics
    from pagewise.platform.tracing import traced_database, traced_quotas
    from pagewise.serving.adapter_store import AdapterStore
    from pagewise.serving.host import EngineHost
    from pagewise.serving.protocol import RedisKeys
    from pagewise.tracing import configure_from_env
    from pagewise.worker.metrics_server import serve_metrics
    from pagewise.worker.redis_worker import RedisWorker

    loop = asyncio.get_running_loop()
    died: list[bool] = []
    holder: list[RedisWorker] = []

    def engine_died() -> None:  # from the engine's thread
        died.append(True)
        if holder:
            loop.call_soon_threadsafe(holder[0].stop)

    configure_from_env("pagewise-worker")
    db = Database(create_db_engine(settings.database_url))
    quotas = RedisQuotaStore.from_url(settings.redis_url, settings.redis_key_prefix, lease_s=settings.quota_lease_s)
    client = redis.Redis.from_url(settings.redis_url)
    try:
        engine = await anyio.to_thread.run_sync(load_engine, settings, engine_died)
        logger.info("%s", engine_summary(engine))
        host = EngineHost(
            engine, RequestStore(db), traced_quotas(quotas), adapters=AdapterStore(settings.adapters_path)
        )
        host.metrics = PlatformMetrics(host.stats, engine.model_name)
        if args.metrics_port is not None:
            serve_metrics(host.metrics.registry, args.metrics_host, args.metrics_port, settings.metrics_token)
        worker = RedisWorker(
            host,
            client,
            RedisKeys(settings.redis_key_prefix),
            worker_id=args.worker_id,
            heartbeat_s=settings.worker_heartbeat_s,
            max_deliveries=settings.max_deliveries,
        )
        holder.append(worker)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stop)
        with traced_database(db):
            await worker.run()
        engine.shutdown()
    finally:
        await client.aclose()
        await quotas.close()
        await db.dispose()
    return ExitStatus.ENGINE_DIED if died else ExitStatus.OK
