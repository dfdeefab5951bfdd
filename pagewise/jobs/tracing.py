"""Each job runs in its own span, linked to the work that queued it (see `pagewise.tracing`).

Invariants:
- A task published while a span is current carries that span's context as its `traceparent` message header
  (`before_task_publish`; a header already there is kept, so a retry stays linked to the original trigger).
- `TracedTask` runs every task inside a CONSUMER span named after the task, with a link — not a parent — to the
  context its `traceparent` names: a job is a trace of its own (an export may run long after the request that
  queued it ended), and the link leads from it to that request's trace (or to the job that queued it). A task
  published outside any span carries no header and its span has no link. An exception is recorded on the span.
- Spans carry the task's name, id and attempt, and what a task adds itself; never its arguments wholesale.
- A worker's pool process flushes its spans before it exits.
"""

from __future__ import annotations

from typing import Any

from celery import Task
from celery.signals import before_task_publish, worker_process_shutdown
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pagewise import tracing

TRACEPARENT = "traceparent"
_PROPAGATOR = TraceContextTextMapPropagator()


@before_task_publish.connect
def _add_traceparent(headers: dict[str, Any] | None = None, **_: Any) -> None:
    if headers is None or TRACEPARENT in headers or not trace.get_current_span().get_span_context().is_valid:
        return
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    headers[TRACEPARENT] = carrier[TRACEPARENT]


def _links(traceparent: str | None) -> list[Link]:
    """A link to the span `traceparent` names; none without one (or with one that does not parse)."""
    context = tracing.continued(traceparent)
    span_context = trace.get_current_span(context).get_span_context() if context is not None else None
    return [Link(span_context)] if span_context is not None and span_context.is_valid else []


class TracedTask(Task):
    """The base of every pagewise task: its run is a span (a no-op when tracing is off).

    The worker (and `apply`) pushes the task's request before calling this, so `run` is called directly: the
    base `__call__` would push a second, empty request over it (no id, no headers) for the body to see."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        attributes = {
            "messaging.system": "celery",
            "messaging.operation.type": "process",
            "messaging.message.id": request.id or "",
            "pagewise.job.attempt": (request.retries or 0) + 1,
        }
        links = _links((request.headers or {}).get(TRACEPARENT))
        with tracing.tracer().start_as_current_span(
            self.name, kind=SpanKind.CONSUMER, links=links, attributes=attributes
        ):
            return self.run(*args, **kwargs)


@worker_process_shutdown.connect
def _flush_spans(**_: Any) -> None:
    flush = getattr(tracing.provider(), "force_flush", None)  # the SDK's provider has it; the no-op one not
    if flush is not None:
        flush()
