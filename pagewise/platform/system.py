"""Operational routes: `/health` (liveness) and `/ready` (model, database and quota store) are public; `/metrics` needs
the metrics token (`PAGEWISE_METRICS_TOKEN`) or an admin key as its bearer."""

from __future__ import annotations

import asyncio

import msgspec
from litestar import Request, Response, get
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text

from pagewise.platform.keys.auth import authorize_metrics, client_address
from pagewise.platform.services import Services

READY_TIMEOUT_S = 2.0  # a database that does not answer a `SELECT 1` within this is not ready


class Health(msgspec.Struct):
    status: str


class Readiness(msgspec.Struct):
    status: str
    model_loaded: bool
    database: bool
    quotas: bool  # the quota store answers (Redis, where quotas live there)


@get("/health", tags=["system"])
async def health() -> Health:
    return Health("ok")


@get("/ready", tags=["system"])
async def ready(services: Services) -> Response[Readiness]:
    """200 once the model is loaded and the database and the quota store answer; 503 otherwise (a load balancer
    then stops sending requests that could only fail)."""
    model_loaded = services.engine.is_ready()
    try:
        async with asyncio.timeout(READY_TIMEOUT_S), services.sessionmaker() as session:
            await session.execute(text("SELECT 1"))
        database = True
    except Exception:  # noqa: BLE001 - any failure means "not ready"
        database = False
    quotas = await services.quotas.ping()
    ok = model_loaded and database and quotas
    return Response(
        Readiness("ready" if ok else "not_ready", model_loaded, database, quotas), status_code=200 if ok else 503
    )


@get("/metrics", tags=["system"], media_type=CONTENT_TYPE_LATEST)
async def metrics(request: Request, services: Services) -> Response[bytes]:
    """Prometheus text; 401 without the metrics token or an API key, 403 for a key without `admin`."""
    await authorize_metrics(
        services.database,
        request.headers.get("authorization"),
        services.settings.metrics_token,
        services.auth_failures,
        client_address(request),
    )
    return Response(services.metrics.render(), media_type=CONTENT_TYPE_LATEST)
