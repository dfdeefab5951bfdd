"""One trace per inference request in the embedded mode (the loopback transport), read from the SDK's in-memory
exporter: the expected spans, each under its expected parent, the GenAI attributes, and no prompt text or key
secret anywhere in the trace."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Sequence

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, format_span_id, format_trace_id

from pagewise.platform.tracing import TRACE_ID_HEADER

from ..harness import Platform, bearer, chat_body

pytestmark = pytest.mark.anyio
PROMPT = "Tell me about the secret garden of Zanzibar"
SERVER_SPAN = "POST /v1/chat/completions"
API_SPANS = {SERVER_SPAN, "pagewise.auth", "pagewise.quota.reserve", "pagewise.enqueue"}
ENGINE_SPANS = {
    "pagewise.execute",
    "pagewise.schedule",
    "pagewise.prefill",
    "pagewise.decode",
    "pagewise.persist",
    "pagewise.quota.reconcile",
}


async def _trace(spans: InMemorySpanExporter, trace_id: str) -> dict[str, list[ReadableSpan]]:
    """The trace's finished spans by name, once the engine's side has ended its spans too."""
    for _ in range(100):
        mine = [s for s in spans.get_finished_spans() if format_trace_id(s.context.trace_id) == trace_id]
        by_name: dict[str, list[ReadableSpan]] = {}
        for span in mine:
            by_name.setdefault(span.name, []).append(span)
        if by_name.keys() >= API_SPANS | ENGINE_SPANS:
            return by_name
        await asyncio.sleep(0.05)
    raise AssertionError(f"missing spans: {sorted(API_SPANS | ENGINE_SPANS - by_name.keys())}")


def _parent(span: ReadableSpan) -> str | None:
    return None if span.parent is None else format_span_id(span.parent.span_id)


def _id(span: ReadableSpan) -> str:
    return format_span_id(span.context.span_id)


def _texts(spans: Sequence[ReadableSpan]) -> str:
    """Every attribute and event of `spans`, as one string to search."""
    parts = []
    for span in spans:
        parts.append(json.dumps(dict(span.attributes or {}), default=str))
        parts.extend(json.dumps([e.name, dict(e.attributes or {})], default=str) for e in span.events)
    return "\n".join(parts)


async def test_a_chat_completion_is_one_trace_from_the_http_span_to_the_quota_reconcile(
    platform: Platform, spans: InMemorySpanExporter
) -> None:
    tenant, key = await platform.tenant_with_key()
    response = await platform.http.post(
        "/v1/chat/completions", json=chat_body(PROMPT, max_tokens=6, ignore_eos=True), headers=bearer(key)
    )
    assert response.status_code == 200, response.text
    trace_id = response.headers[TRACE_ID_HEADER]
    by_name = await _trace(spans, trace_id)
    one = {name: group[0] for name, group in by_name.items()}
    assert all(len(by_name[name]) == 1 for name in API_SPANS | ENGINE_SPANS)

    server, execute = one[SERVER_SPAN], one["pagewise.execute"]
    assert server.parent is None and server.kind is SpanKind.SERVER
    for name in ("pagewise.auth", "pagewise.quota.reserve", "pagewise.enqueue"):
        assert _parent(one[name]) == _id(server), name
    assert one["pagewise.enqueue"].kind is SpanKind.PRODUCER
    assert execute.kind is SpanKind.CONSUMER and _parent(execute) == _id(one["pagewise.enqueue"])
    for name in ("pagewise.schedule", "pagewise.prefill", "pagewise.decode", "pagewise.persist"):
        assert _parent(one[name]) == _id(execute), name
    assert _parent(one["pagewise.quota.reconcile"]) == _id(execute)
    sql = [s for s in sum(by_name.values(), []) if s.kind is SpanKind.CLIENT]
    inserts = [s for s in sql if s.name.startswith("INSERT") and _parent(s) == _id(server)]
    assert inserts, [s.name for s in sql]  # the queued row, written under the HTTP span
    assert any(_parent(s) == _id(one["pagewise.persist"]) for s in sql)  # the final row
    schedule, prefill, decode = one["pagewise.schedule"], one["pagewise.prefill"], one["pagewise.decode"]
    assert execute.start_time <= schedule.start_time <= schedule.end_time == prefill.start_time  # queue, then steps
    assert prefill.end_time == decode.start_time <= decode.end_time <= one["pagewise.persist"].start_time

    usage = response.json()["usage"]
    assert execute.attributes["gen_ai.request.model"] == chat_body()["model"]
    assert execute.attributes["gen_ai.operation.name"] == "chat"
    assert execute.attributes["pagewise.tenant.id"] == tenant["id"]
    assert execute.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert execute.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 6
    assert execute.attributes["pagewise.cached_tokens"] == 0
    assert execute.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert execute.attributes["pagewise.status"] == "completed"
    assert execute.attributes["pagewise.preemptions"] == 0
    assert schedule.attributes["pagewise.cached_tokens"] == 0 and schedule.attributes["pagewise.kv.blocks"] >= 1
    assert schedule.attributes["pagewise.engine.step"] == prefill.attributes["pagewise.engine.step"] >= 1
    assert prefill.attributes["pagewise.prefill.tokens"] == usage["prompt_tokens"]  # one chunk: the whole prompt
    assert prefill.attributes["pagewise.prefill.recompute"] is False
    assert server.attributes["pagewise.tenant.id"] == tenant["id"]
    assert server.attributes["gen_ai.usage.output_tokens"] == 6
    assert server.attributes["gen_ai.response.id"] == response.json()["id"]
    assert [e.name for e in server.events] == ["gen_ai.first_token"]
    assert [e.name for e in one["pagewise.decode"].events] == ["gen_ai.first_token"]
    reserve = one["pagewise.quota.reserve"].attributes
    assert reserve["pagewise.quota.decision"] == "admitted" and "pagewise.quota.rejected_by" not in reserve
    assert one["pagewise.quota.reconcile"].attributes["pagewise.quota.reconciled"] is True

    prefix, secret = key.split("_", 2)[1:]
    assert one["pagewise.auth"].attributes == {"pagewise.api_key.prefix": prefix, "pagewise.tenant.id": tenant["id"]}
    everything = _texts(sum(by_name.values(), []))
    assert "Zanzibar" not in everything and secret not in everything
    assert response.json()["choices"][0]["message"]["content"] not in everything
    row = await platform.http.get(f"/admin/requests/{response.json()['id']}", headers=bearer(platform.admin_key))
    assert row.json()["trace_id"] == trace_id  # an operator goes from the request to its trace


async def test_a_streamed_request_has_no_span_per_token(platform: Platform, spans: InMemorySpanExporter) -> None:
    _, key = await platform.tenant_with_key()
    body = chat_body(PROMPT, max_tokens=100, ignore_eos=True, stream=True)
    async with platform.http.stream("POST", "/v1/chat/completions", json=body, headers=bearer(key)) as response:
        assert response.status_code == 200
        chunks = [line async for line in response.aiter_lines() if line.startswith("data: {")]
        trace_id = response.headers[TRACE_ID_HEADER]
    assert len(chunks) >= 100
    by_name = await _trace(spans, trace_id)
    counts = {name: len(group) for name, group in by_name.items()}
    assert sum(counts.values()) < len(chunks) / 2, counts  # SQL statements and connections, not tokens
    assert all(count == 1 for name, count in counts.items() if name.startswith(("pagewise.", "POST"))), counts
    assert len(by_name["pagewise.decode"][0].events) == 1


async def test_a_quota_rejection_names_its_limit_on_the_reserve_span(
    platform: Platform, spans: InMemorySpanExporter
) -> None:
    _, key = await platform.tenant_with_key(tokens_per_minute=100)
    body = chat_body(max_tokens=60, ignore_eos=True)  # ~85 tokens reserved: one fits a minute, two do not
    assert (await platform.http.post("/v1/chat/completions", json=body, headers=bearer(key))).status_code == 200
    response = await platform.http.post("/v1/chat/completions", json=body, headers=bearer(key))
    assert response.status_code == 429, response.text
    trace_id = response.headers[TRACE_ID_HEADER]
    mine = {s.name: s for s in spans.get_finished_spans() if format_trace_id(s.context.trace_id) == trace_id}
    assert "pagewise.enqueue" not in mine and "pagewise.execute" not in mine
    reserve = mine["pagewise.quota.reserve"].attributes
    assert reserve["pagewise.quota.decision"] == "rejected" and reserve["pagewise.quota.rejected_by"] == "tokens"


async def test_health_checks_and_background_work_start_no_trace(
    platform: Platform, spans: InMemorySpanExporter
) -> None:
    spans.clear()
    assert (await platform.http.get("/health")).status_code == 200
    await platform.services.requests.fail_orphans(dt.datetime.now(dt.UTC))  # SQL outside any request
    assert spans.get_finished_spans() == ()
