"""Each job runs in a span of its own, exported by the real worker over OTLP: a consumer span named after the task,
in a trace of its own, linked to what queued it — the API request that queued an export (its traceparent travels in
the task's headers), or the `export_all` job that queued one per tenant. A failing job's span says so."""

from __future__ import annotations

import datetime as dt
import secrets
import time
from collections.abc import Iterator

import httpx
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import format_span_id

from pagewise.jobs.database import session_factory
from pagewise.platform.app import create_app
from pagewise.platform.db.ids import new_id
from pagewise.platform.db.models import Tenant, UsageDaily
from pagewise.platform.keys.schemas import KeyCreate
from pagewise.platform.keys.service import KeyService
from pagewise.platform.tenants.schemas import TenantCreate
from pagewise.platform.tenants.service import TenantService
from pagewise.platform.tracing import TRACE_ID_HEADER

from ..harness import bearer, spans_in_memory
from .conftest import Jobs

SPAN_KIND_CONSUMER = Span.SpanKind.SPAN_KIND_CONSUMER


@pytest.fixture
def api_spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process (the API's side), into memory."""
    with spans_in_memory() as exporter:
        yield exporter


def _attributes(span: Span) -> dict[str, object]:
    values = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        values[a.key] = getattr(a.value, kind)
    return values


def _job_spans(jobs: Jobs, name: str, timeout_s: float = 30, **attributes: object) -> list[Span]:
    """The worker's spans named `name` whose attributes include `attributes`, once there is at least one."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [
            span
            for service, span in jobs.spans.snapshot()
            if service == "pagewise-jobs"
            and span.name == name
            and attributes.items() <= _attributes(span).items()
        ]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@pytest.mark.anyio
async def test_an_export_queued_by_the_api_links_to_the_request_that_queued_it(
    jobs: Jobs, jobs_database: str, llm_engine, api_spans: InMemorySpanExporter
) -> None:
    settings = jobs.api_settings(jobs_database)
    app = create_app(settings, engine=llm_engine)
    transport = httpx.ASGITransport(app=app)
    async with app.lifespan(), httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        async with app.state.sessionmaker() as session:
            ops = await TenantService(session).create(TenantCreate(name=f"ops-{secrets.token_hex(4)}"))
            admin = bearer((await KeyService(session).create(ops.id, KeyCreate(scopes=["admin"]))).key)
        tenant = await http.post("/admin/tenants", json={"name": f"spans-{secrets.token_hex(4)}"}, headers=admin)
        tenant_id = tenant.json()["id"]
        queued = await http.post("/admin/exports", json={"tenant_id": tenant_id, "period": "2026-02"}, headers=admin)
    assert queued.status_code == 202, queued.text
    trace_id = queued.headers[TRACE_ID_HEADER]
    server = next(s for s in api_spans.get_finished_spans() if s.name == "POST /admin/exports")
    assert format(server.context.trace_id, "032x") == trace_id

    [job] = _job_spans(jobs, "pagewise.export_month", **{"messaging.message.id": queued.json()["task_id"]})
    assert job.kind == SPAN_KIND_CONSUMER and not job.parent_span_id  # a trace of its own …
    assert job.trace_id.hex() != trace_id
    assert [(link.trace_id.hex(), link.span_id.hex()) for link in job.links] == [
        (trace_id, format_span_id(server.context.span_id))  # … linked to the request that queued it
    ]
    attributes = _attributes(job)
    assert (attributes["pagewise.tenant.id"], attributes["pagewise.export.period"]) == (tenant_id, "2026-02")
    assert attributes["pagewise.export.revision"] == 1 and attributes["pagewise.job.attempt"] == 1
    assert job.status.code != Status.StatusCode.STATUS_CODE_ERROR


def test_export_all_links_each_export_to_itself_and_a_failed_job_is_an_error(jobs: Jobs, jobs_database: str) -> None:
    period = "2019-03"  # no other test has usage in it: `export_all` queues this tenant's export only
    tenant_id = new_id("ten")
    with session_factory(jobs_database)() as session, session.begin():
        session.add(Tenant(id=tenant_id, name=f"spans-{secrets.token_hex(4)}", status="active"))
        session.flush()
        session.add(UsageDaily(tenant_id=tenant_id, day=dt.date(2019, 3, 9), model="m", api_key_id="", requests=1,
                               prompt_tokens=5, completion_tokens=2, cached_tokens=0, cost_micros=31))
    assert jobs.run("pagewise.export_all", period) == [tenant_id]

    [parent] = _job_spans(jobs, "pagewise.export_all")  # queued from outside any span: no link
    assert parent.kind == SPAN_KIND_CONSUMER and not parent.links and not parent.parent_span_id
    [child] = _job_spans(jobs, "pagewise.export_month", **{"pagewise.tenant.id": tenant_id})
    assert [(link.trace_id, link.span_id) for link in child.links] == [(parent.trace_id, parent.span_id)]
    assert child.trace_id != parent.trace_id

    missing = new_id("ten")  # an id of this test's own: the worker (and its spans) serve the whole session
    with pytest.raises(Exception, match="no tenant"):
        jobs.run("pagewise.export_month", missing, period)
    [failed] = _job_spans(jobs, "pagewise.export_month", **{"pagewise.tenant.id": missing})
    assert failed.status.code == Status.StatusCode.STATUS_CODE_ERROR
    assert [event.name for event in failed.events] == ["exception"]
