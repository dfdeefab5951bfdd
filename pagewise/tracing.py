"""OpenTelemetry traces: one trace per inference request, across the API, the transport and the engine's side.

Invariants:
- Configured only by the standard variables (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`,
  `OTEL_SERVICE_NAME`, `OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_SDK_DISABLED`; see `pagewise.tracing_export`). With no
  endpoint, or with the SDK disabled, nothing is installed: `tracer()` is OpenTelemetry's no-op tracer (a span
  records nothing), and `enabled()` is False, so no instrumentation (HTTP middleware, SQLAlchemy) is added.
- Context crosses processes only as `Submit.traceparent` (W3C trace context), set by the transport that sends
  the Submit (`with_traceparent`) and continued by the execution that runs it (`continued`).
- Attributes carry counts, ids and parameters, never a prompt or an output.

Only the OpenTelemetry API is imported here; the SDK loads when a provider is built.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import msgspec
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NoOpTracerProvider, Span, SpanKind, Tracer, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pagewise.serving.protocol import Reservation, Submit, Usage

INSTRUMENTATION_NAME = "pagewise"
_PROPAGATOR = TraceContextTextMapPropagator()
_NO_OP = NoOpTracerProvider()
_OPERATIONS = {"chat.completions": "chat", "completions": "text_completion"}  # GenAI `gen_ai.operation.name`


class _State:
    provider: TracerProvider = _NO_OP
    tracer: Tracer = _NO_OP.get_tracer(INSTRUMENTATION_NAME)
    configured = False  # the environment was read (once per process)


def use(provider: TracerProvider | None) -> None:
    """Trace with `provider` from now on (a test's in-memory exporter); `None` turns tracing off again."""
    _State.provider = provider or _NO_OP
    _State.tracer = _State.provider.get_tracer(INSTRUMENTATION_NAME)


def configure_from_env(service_name: str) -> bool:
    """Install an OTLP/HTTP exporting provider if the environment asks for one (first call per process only;
    `service_name` unless `OTEL_SERVICE_NAME` names the service). Returns `enabled()`."""
    if not _State.configured and _State.provider is _NO_OP:
        _State.configured = True
        if _exporting_requested(os.environ):
            from pagewise.tracing_export import otlp_provider

            provider = otlp_provider(service_name)
            trace.set_tracer_provider(provider)
            use(provider)
    return enabled()


def _exporting_requested(env: Mapping[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def enabled() -> bool:
    return _State.provider is not _NO_OP


def provider() -> TracerProvider:
    return _State.provider


def tracer() -> Tracer:
    return _State.tracer


def with_traceparent(submit: Submit) -> Submit:
    """`submit` carrying the current span's context; unchanged when there is none (tracing off)."""
    if not trace.get_current_span().get_span_context().is_valid:
        return submit
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return msgspec.structs.replace(submit, traceparent=carrier["traceparent"])


@contextmanager
def enqueue_span(submit: Submit, system: str, destination: str) -> Iterator[Submit]:
    """A producer span around handing `submit` to an engine; yields the Submit to send: it carries this span's
    context, so the engine's side continues the trace from here."""
    attributes = {
        **request_attributes(submit),
        "messaging.system": system,
        "messaging.destination.name": destination,
        "messaging.operation.type": "send",
    }
    with _State.tracer.start_as_current_span("pagewise.enqueue", kind=SpanKind.PRODUCER, attributes=attributes):
        yield with_traceparent(submit)


def continued(traceparent: str | None) -> Context | None:
    """The remote context a Submit's `traceparent` names (`None`: none, a new trace starts)."""
    return None if traceparent is None else _PROPAGATOR.extract({"traceparent": traceparent})


def trace_id(span: Span | None = None) -> str | None:
    """The 32-hex-digit trace id of `span` (default: the current one); `None` when not tracing."""
    context = (span or trace.get_current_span()).get_span_context()
    return trace.format_trace_id(context.trace_id) if context.is_valid else None


def request_attributes(submit: Submit) -> dict[str, str | int | float]:
    """What a request asked for, in GenAI semantic-convention names plus pagewise's own."""
    params = submit.params
    return {
        "gen_ai.operation.name": _OPERATIONS.get(submit.endpoint, submit.endpoint),
        "gen_ai.request.model": submit.model,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.choice.count": params.n,
        "pagewise.request.id": submit.request_id,
        "pagewise.tenant.id": submit.tenant_id,
        "pagewise.prompts": len(submit.prompts),
    }


def usage_attributes(usage: Usage, finish_reasons: list[str]) -> dict[str, int | list[str]]:
    """What a request cost and how its choices ended."""
    return {
        "gen_ai.usage.input_tokens": usage.prompt_tokens,
        "gen_ai.usage.output_tokens": usage.completion_tokens,
        "pagewise.cached_tokens": usage.cached_tokens,
        "gen_ai.response.finish_reasons": finish_reasons,
    }


@contextmanager
def reconcile_span(reservation: Reservation, actual_tokens: int) -> Iterator[Span]:
    """The `pagewise.quota.reconcile` span (a no-op one with tracing off); the caller sets
    `pagewise.quota.reconciled` once it knows."""
    attributes = {"pagewise.tenant.id": reservation.tenant_id, "pagewise.quota.tokens": actual_tokens}
    with tracer().start_as_current_span("pagewise.quota.reconcile", attributes=attributes) as span:
        yield span
