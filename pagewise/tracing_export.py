"""The OpenTelemetry SDK side of `pagewise.tracing`: a provider exporting over OTLP/HTTP, built from the standard
variables. Imported only when tracing is configured (the SDK and the exporter take ~0.2 s to import).

- Endpoint, headers, timeout: `OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT` and friends, read by the exporter;
  batching: `OTEL_BSP_*`, read by the batch processor, flushed at exit.
- Sampling: `OTEL_TRACES_SAMPLER[_ARG]` (default `parentbased_always_on`), except that a trace starts only at a
  request — an HTTP server span or an engine's consumer span. Any other span without a parent (a lease renewal's
  or a sweep's SQL, a heartbeat) is dropped, so background work never floods the traces.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult, _get_from_env_or_default
from opentelemetry.trace import Link, SpanKind, TraceState, get_current_span
from opentelemetry.util.types import Attributes

REQUEST_ROOT_KINDS = (SpanKind.SERVER, SpanKind.CONSUMER)


class RequestRootSampler(Sampler):
    """`base` for every span, but a span without a parent is recorded only if it starts a request."""

    def __init__(self, base: Sampler) -> None:
        self._base = base

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        has_parent = get_current_span(parent_context).get_span_context().is_valid
        if not has_parent and kind not in REQUEST_ROOT_KINDS:
            return SamplingResult(Decision.DROP)
        return self._base.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"RequestRootSampler{{{self._base.get_description()}}}"


def build_provider(service_name: str) -> TracerProvider:
    """A provider for `service_name` (`OTEL_SERVICE_NAME` wins) sampling as the environment says; no exporter."""
    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or service_name})
    return TracerProvider(resource=resource, sampler=RequestRootSampler(_get_from_env_or_default()))


def otlp_provider(service_name: str) -> TracerProvider:
    """`build_provider` exporting in batches over OTLP/HTTP (protobuf) to the configured endpoint."""
    provider = build_provider(service_name)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider
