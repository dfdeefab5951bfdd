"""The engine side's spans of one execution (see `pagewise.tracing`); never a span per token.

- `pagewise.execute` (kind consumer) continues the Submit's trace and covers the execution from its start to its
  terminal event; the spans the execution's own awaits open (SQL, `pagewise.persist`, the quota reconcile) are its
  children. At its end it carries the outcome: status, billed tokens, finish reasons, the error if any.
- Within it, `pagewise.prefill` runs from the hand-over to the engine to the first token (the engine's queue wait
  and the prompt's processing) and `pagewise.decode` from the first token to the end, with a
  `gen_ai.first_token` event at its start and a `pagewise.tokens` event every `PROGRESS_EVERY` tokens.
- Every span ends exactly once, however the execution ends (an abort, a failure, a cancellation).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, StatusCode

from pagewise import tracing
from pagewise.protocol import ErrorInfo, Event, Finished, Submit

PROGRESS_EVERY = 256  # generated tokens between two `pagewise.tokens` events of the decode span


class RequestTrace:
    def __init__(self, submit: Submit, attempt: int) -> None:
        self._submit, self._attempt = submit, attempt
        self._span: Span = INVALID_SPAN
        self._prefill: Span | None = None
        self._decode: Span | None = None
        self._next_progress = PROGRESS_EVERY

    @contextmanager
    def execution(self) -> Iterator[None]:
        """The `pagewise.execute` span, current while open."""
        attributes = {**tracing.request_attributes(self._submit), "pagewise.attempt": self._attempt}
        parent = tracing.continued(self._submit.traceparent)
        with tracing.tracer().start_as_current_span(
            "pagewise.execute", context=parent, kind=SpanKind.CONSUMER, attributes=attributes
        ) as span:
            self._span = span
            try:
                yield
            finally:
                for phase in (self._prefill, self._decode):
                    if phase is not None and phase.is_recording():
                        phase.end()

    def engine_started(self) -> None:
        """A prompt was handed to the engine (the first one opens the prefill)."""
        if self._prefill is None and self._decode is None:
            self._prefill = self._child("pagewise.prefill")

    def generated(self, num_tokens: int) -> None:
        """`num_tokens` tokens generated so far, all choices together (called as outputs arrive)."""
        if self._decode is None:
            if self._prefill is not None:
                self._prefill.end()
            self._decode = self._child("pagewise.decode")
            self._decode.add_event("gen_ai.first_token")
        while num_tokens >= self._next_progress:
            self._decode.add_event("pagewise.tokens", {"pagewise.generated_tokens": self._next_progress})
            self._next_progress += PROGRESS_EVERY

    @contextmanager
    def persisting(self, status: str) -> Iterator[Span]:
        """The `pagewise.persist` span around the final row's write."""
        with tracing.tracer().start_as_current_span("pagewise.persist", attributes={"pagewise.status": status}) as span:
            yield span

    def ended(self, event: Event, finish_reasons: list[str]) -> None:
        """Record the terminal event on the execution span."""
        span = self._span
        if isinstance(event, Finished):
            span.set_attribute("pagewise.status", event.status)
            span.set_attributes(tracing.usage_attributes(event.usage, finish_reasons))
        else:
            span.set_attribute("pagewise.status", "rejected")
        if event.error is not None:
            _failed(span, event.error)

    def _child(self, name: str) -> Span:
        return tracing.tracer().start_span(name, context=trace.set_span_in_context(self._span))


def _failed(span: Span, error: ErrorInfo) -> None:
    span.set_attribute("error.type", str(error.code))
    span.set_status(StatusCode.ERROR, error.message)
