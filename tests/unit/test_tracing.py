"""`pagewise.tracing` without a server: what the environment turns on, the sampler's rule, the traceparent hop."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from pagewise import tracing
from pagewise.engine.sampling_params import SamplingParams
from pagewise.serving.protocol import Reservation, Submit, decode_submit, encode
from pagewise.tracing_export import build_provider

SUBMIT = Submit(
    request_id="cmpl_1",
    tenant_id="ten_1",
    model="m",
    endpoint="completions",
    prompts=[[1, 2, 3]],
    params=SamplingParams(max_tokens=4),
    reservation=Reservation("cmpl_1", "ten_1", 7, 0, "203001"),
)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "api", "OTEL_TRACES_SAMPLER": "always_on"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SDK_DISABLED": "TRUE"}, False),
    ],
)
def test_only_an_endpoint_turns_exporting_on_and_the_sdk_switch_turns_it_off(env: dict, expected: bool) -> None:
    assert tracing._exporting_requested(env) is expected


def test_unconfigured_tracing_is_the_no_op_tracer_and_sends_no_traceparent() -> None:
    assert not tracing.enabled()
    with tracing.enqueue_span(SUBMIT, "test", "inbox") as sent:
        assert sent is SUBMIT and sent.traceparent is None
        assert tracing.trace_id() is None


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = build_provider("unit")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    yield exporter
    tracing.use(None)


def test_the_traceparent_survives_the_wire_and_parents_the_engine_side(spans: InMemorySpanExporter) -> None:
    tracer = tracing.tracer()
    with (
        tracer.start_as_current_span("request", kind=SpanKind.SERVER),
        tracing.enqueue_span(SUBMIT, "test", "inbox") as sent,
    ):
        producer = trace.get_current_span().get_span_context()
    received = decode_submit(encode(sent))
    with tracer.start_as_current_span("execute", context=tracing.continued(received.traceparent)) as span:
        consumer = span.get_span_context()
    assert consumer.trace_id == producer.trace_id
    execute = next(s for s in spans.get_finished_spans() if s.name == "execute")
    assert execute.parent.span_id == producer.span_id and execute.parent.is_remote


def test_a_trace_starts_only_at_a_request(spans: InMemorySpanExporter) -> None:
    tracer = tracing.tracer()
    with tracer.start_as_current_span("SELECT", kind=SpanKind.CLIENT):  # a sweep's SQL: no request above it
        pass
    with tracer.start_as_current_span("internal"):
        pass
    with (
        tracer.start_as_current_span("GET /x", kind=SpanKind.SERVER),
        tracer.start_as_current_span("SELECT", kind=SpanKind.CLIENT),
    ):
        pass
    assert [s.name for s in spans.get_finished_spans()] == ["SELECT", "GET /x"]


def test_the_environment_names_the_sampler_and_the_service(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    provider = build_provider("pagewise-api")
    assert provider.sampler.get_description() == "RequestRootSampler{TraceIdRatioBased{0.25}}"
    assert provider.resource.attributes["service.name"] == "pagewise-api"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-eu")
    assert build_provider("pagewise-api").resource.attributes["service.name"] == "edge-eu"
