"""The distributed mode's trace: an API replica and a `pagewise worker` (separate processes, a tiny random model)
export over OTLP/HTTP to a receiver this test runs. One request is one trace: the worker's execution span is the
child of the API's enqueue span, across the Redis hop, and no span carries the prompt."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from pagewise.bench.otlp_receiver import Received, otlp_receiver
from pagewise.bench.stack import distributed_stack
from pagewise.platform.db.migrate import upgrade_head
from pagewise.platform.tracing import TRACE_ID_HEADER

from ..conftest import REDIS_URL
from ..harness import bearer

PROMPT = "The lighthouse keeper of Zanzibar counted the ships"
EXPECTED = {
    ("pagewise-api", "POST /v1/completions"),
    ("pagewise-api", "pagewise.auth"),
    ("pagewise-api", "pagewise.quota.reserve"),
    ("pagewise-api", "pagewise.enqueue"),
    ("pagewise-worker", "pagewise.execute"),
    ("pagewise-worker", "pagewise.schedule"),
    ("pagewise-worker", "pagewise.prefill"),
    ("pagewise-worker", "pagewise.decode"),
    ("pagewise-worker", "pagewise.persist"),
    ("pagewise-worker", "pagewise.quota.reconcile"),
}


def _wait_for_trace(received: Received, trace_id: bytes, timeout_s: float = 30) -> dict[tuple[str, str], Span]:
    deadline = time.monotonic() + timeout_s
    while True:
        spans = {(service, s.name): s for service, s in received.snapshot() if s.trace_id == trace_id}
        if spans.keys() >= EXPECTED or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)


def test_one_trace_crosses_from_the_api_to_the_worker(
    tmp_path: Path, tiny_model: Callable, fresh_database: Callable[[str], str]
) -> None:
    model, _ = tiny_model("tracing")
    database_url = fresh_database("postgres")
    upgrade_head(database_url)
    engine_args = ["--model", str(model), "--max-model-len", "128"]
    with otlp_receiver() as received:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": received.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        with distributed_stack(tmp_path, database_url, engine_args, workers=1, redis_url=REDIS_URL, env=env) as stack:
            admin = bearer(stack.api.admin_key)
            with httpx.Client(base_url=stack.api.base, timeout=60) as http:
                tenant = http.post("/admin/tenants", json={"name": "traced"}, headers=admin).json()
                key = http.post(f"/admin/tenants/{tenant['id']}/keys", json={}, headers=admin).json()["key"]
                body = {"model": str(model), "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
                response = http.post("/v1/completions", json=body, headers=bearer(key))
            assert response.status_code == 200, response.text
            trace_id = bytes.fromhex(response.headers[TRACE_ID_HEADER])
            spans = _wait_for_trace(received, trace_id)

    assert spans.keys() >= EXPECTED, sorted(EXPECTED - spans.keys())
    enqueue, execute = spans[("pagewise-api", "pagewise.enqueue")], spans[("pagewise-worker", "pagewise.execute")]
    assert execute.parent_span_id == enqueue.span_id  # the parent link crosses the process boundary
    server = spans[("pagewise-api", "POST /v1/completions")]
    assert enqueue.parent_span_id == server.span_id and not server.parent_span_id
    for name in ("pagewise.schedule", "pagewise.prefill", "pagewise.decode"):  # engine timestamps, in the execution
        span = spans[("pagewise-worker", name)]
        assert span.parent_span_id == execute.span_id, name
        assert execute.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano, name
        assert span.end_time_unix_nano <= execute.end_time_unix_nano, name
    attributes = {a.key: a.value for a in execute.attributes}
    assert attributes["gen_ai.request.model"].string_value == str(model)
    assert attributes["gen_ai.usage.output_tokens"].int_value == 5
    assert attributes["pagewise.tenant.id"].string_value == tenant["id"]
    assert attributes["gen_ai.response.finish_reasons"].array_value.values[0].string_value == "length"
    assert not any("Zanzibar" in str(s) for s in spans.values())  # no prompt text in any span
