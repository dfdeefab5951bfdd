"""The API's part of a request's trace (see `pagewise.tracing`), added to an app only when tracing is enabled.

- The HTTP server span: Litestar's OpenTelemetry plugin (ASGI instrumentation), without a span per `send` or
  `receive` (so none per streamed chunk), and not on `/health`, `/ready` or `/metrics`.
- `pagewise.auth`: the tenant and the key's prefix — never its secret.
- `pagewise.quota.reserve` / `pagewise.quota.reconcile`: the decision and the limit that refused, if one did.
- SQL statements as client spans (SQLAlchemy instrumentation; statements only, bound values never).
- The trace id of every traced response in `x-pagewise-trace-id`, so a caller can name its trace.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from litestar.connection import ASGIConnection
from litestar.datastructures import MutableScopeHeaders
from litestar.middleware import AuthenticationResult
from litestar.plugins import InitPlugin
from litestar.types import Message, Scope
from opentelemetry import trace

from pagewise import tracing
from pagewise.platform.db.database import Database
from pagewise.platform.keys.auth import ApiKeyAuthMiddleware, Principal, bearer_token
from pagewise.platform.keys.key_format import parse_key
from pagewise.platform.quotas.quota_store import Decision, QuotaLimits, QuotaStore
from pagewise.serving.protocol import Reservation

TRACE_ID_HEADER = "x-pagewise-trace-id"
UNTRACED_PATHS = ("/health", "/ready", "/metrics")


def server_span_plugin() -> InitPlugin:
    """Litestar's OpenTelemetry plugin on pagewise's tracer provider."""
    from litestar.plugins.opentelemetry import OpenTelemetryConfig, OpenTelemetryPlugin

    config = OpenTelemetryConfig(
        tracer_provider=tracing.provider(),
        exclude=[f"^{path}" for path in UNTRACED_PATHS],
        exclude_spans=["receive", "send"],
    )
    return OpenTelemetryPlugin(config)


async def add_trace_id_header(message: Message, scope: Scope) -> None:
    """A `before_send` hook: the trace id on a traced response's start."""
    if message["type"] != "http.response.start":
        return
    trace_id = tracing.trace_id()
    if trace_id is not None:
        MutableScopeHeaders.from_message(message)[TRACE_ID_HEADER] = trace_id


class TracedApiKeyAuthMiddleware(ApiKeyAuthMiddleware):
    """`ApiKeyAuthMiddleware` in a `pagewise.auth` span; the tenant also goes on the server span."""

    async def authenticate_request(self, connection: ASGIConnection) -> AuthenticationResult:
        server_span = trace.get_current_span()
        key = parse_key(bearer_token(connection.headers.get("authorization")) or "")
        with tracing.tracer().start_as_current_span("pagewise.auth") as span:
            if key is not None:
                span.set_attribute("pagewise.api_key.prefix", key.prefix)
            result = await super().authenticate_request(connection)
            principal: Principal = result.user
            span.set_attribute("pagewise.tenant.id", principal.tenant_id)
            server_span.set_attribute("pagewise.tenant.id", principal.tenant_id)
            return result


class TracedQuotaStore:
    """A `QuotaStore` whose `reserve` and `reconcile` are spans. Arguments pass through as given and every other
    member is the wrapped store's, so the wrapper follows the store's protocol as it grows."""

    def __init__(self, store: QuotaStore) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def reserve(self, tenant_id: str, limits: QuotaLimits, tokens: int, *args: Any, **kwargs: Any) -> Decision:
        attributes = {"pagewise.tenant.id": tenant_id, "pagewise.quota.tokens": tokens}
        with tracing.tracer().start_as_current_span("pagewise.quota.reserve", attributes=attributes) as span:
            decision = await self.store.reserve(tenant_id, limits, tokens, *args, **kwargs)
            span.set_attribute("pagewise.quota.decision", "admitted" if decision.reservation else "rejected")
            if decision.rejected_by is not None:
                span.set_attribute("pagewise.quota.rejected_by", decision.rejected_by)
            return decision

    async def reconcile(self, reservation: Reservation, actual_tokens: int, actual_cost: int | None = None) -> bool:
        with tracing.reconcile_span(reservation, actual_tokens) as span:
            reconciled = await self.store.reconcile(reservation, actual_tokens, actual_cost)
            span.set_attribute("pagewise.quota.reconciled", reconciled)
            return reconciled


def traced_quotas(store: QuotaStore) -> QuotaStore:
    """`store` in spans when tracing is enabled; `store` itself otherwise."""
    return TracedQuotaStore(store) if tracing.enabled() else store


@contextmanager
def traced_database(database: Database) -> Iterator[None]:
    """While open, `database`'s statements (its async engine's and its units of work's) are client spans, when
    tracing is enabled. One instrumented database per process at a time: SQLAlchemy's instrumentor is a
    process-wide singleton."""
    if not tracing.enabled():
        yield
        return
    from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor

    instrumentor = SQLAlchemyInstrumentor()
    engines = [database.engine.sync_engine, *([database.sync_engine] if database.sync_engine is not None else [])]
    # its declared range stops below SQLAlchemy 2.1, whose engine events it hooks are unchanged
    instrumentor.instrument(engines=engines, tracer_provider=tracing.provider(), skip_dep_check=True)
    try:
        yield
    finally:
        instrumentor.uninstrument()
