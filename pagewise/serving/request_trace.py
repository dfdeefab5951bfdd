"""The engine side's spans of one execution (see `pagewise.tracing`); never a span per token.

- `pagewise.execute` (kind consumer) continues the Submit's trace and covers the execution from its start to its
  terminal event; the spans the execution's own awaits open (SQL, `pagewise.persist`, the quota reconcile) are its
  children. At its end it carries the outcome: status, billed tokens, finish reasons, `pagewise.preemptions`, the
  error if any.
- Its engine children are built from what the engine reports on each output (`RequestMetrics`, `RequestEvent`s),
  with the engine's own timestamps:
  - `pagewise.schedule`, one per prompt: from the prompt's arrival in the engine to the start of the step that
    admitted it (its queue wait), with that step's number, the prefix-cache hit and the blocks it held;
  - `pagewise.prefill`, one per prefill chunk: the step that computed it, with its token count (a recompute after
    a preemption is a chunk too, marked `pagewise.prefill.recompute`);
  - `pagewise.decode`: from the first token (a `gen_ai.first_token` event) to the last prompt's finish, with a
    `pagewise.tokens` event every `PROGRESS_EVERY` tokens and a `pagewise.preempted` / `pagewise.resumed` event
    for each preemption and its resumption (`pagewise.preemption.mode` `swap` — a swap out and in — or
    `recompute`). A preemption before the first token is an event of `pagewise.execute` instead.
- With tracing off (or the execution not sampled) nothing is built: each output costs one `is_recording()` call.
- Every span ends exactly once, however the execution ends (an abort, a failure, a cancellation).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, StatusCode

from pagewise import tracing
from pagewise.engine.outputs import (
    Preempted,
    PrefillChunk,
    RequestEvent,
    RequestMetrics,
    RequestOutput,
    Resumed,
    Scheduled,
)
from pagewise.serving.protocol import ErrorInfo, Event, Finished, Submit

PROGRESS_EVERY = 256  # generated tokens between two `pagewise.tokens` events of the decode span


class RequestTrace:
    def __init__(self, submit: Submit, attempt: int) -> None:
        self._submit, self._attempt = submit, attempt
        self._span: Span = INVALID_SPAN
        self._decode: Span | None = None
        self._first_token: float | None = None  # engine clock
        self._next_progress = PROGRESS_EVERY
        self._preemptions = [0] * len(submit.prompts)
        self._finished: list[float | None] = []  # per finished prompt: its finish (engine clock), if it had one
        self._clock_offset_ns = time.time_ns() - time.monotonic_ns()  # the engine's clock to the wall clock

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
                if self._decode is not None and self._decode.is_recording():
                    self._decode.end()

    def engine_output(self, prompt: int, output: RequestOutput, num_generated: int) -> None:
        """An output of prompt `prompt` arrived; `num_generated` tokens so far, all prompts and choices together."""
        if not self._span.is_recording():
            return
        metrics = output.metrics
        assert metrics is not None  # the engine sets it on every output
        if self._decode is None and metrics.first_token_time is not None:
            self._first_token = metrics.first_token_time
            self._decode = self._child("pagewise.decode", self._first_token)
            self._decode.add_event("gen_ai.first_token", timestamp=self._ns(self._first_token))
        for event in output.events:
            self._event(prompt, metrics, event)
        while self._decode is not None and num_generated >= self._next_progress:
            self._decode.add_event("pagewise.tokens", {"pagewise.generated_tokens": self._next_progress})
            self._next_progress += PROGRESS_EVERY
        self._preemptions[prompt] = metrics.num_preemptions
        if output.finished:
            self._finished.append(metrics.finished_time)
            if len(self._finished) == len(self._preemptions) and self._decode is not None:
                ends = [t for t in self._finished if t is not None]
                self._decode.end(self._ns(max(ends)) if len(ends) == len(self._finished) else None)

    def ended(self, event: Event, finish_reasons: list[str]) -> None:
        """Record the terminal event on the execution span."""
        span = self._span
        if isinstance(event, Finished):
            span.set_attribute("pagewise.status", event.status)
            span.set_attributes(tracing.usage_attributes(event.usage, finish_reasons))
            span.set_attribute("pagewise.preemptions", sum(self._preemptions))
        else:
            span.set_attribute("pagewise.status", "rejected")
        if event.error is not None:
            _failed(span, event.error)

    def _event(self, prompt: int, metrics: RequestMetrics, event: RequestEvent) -> None:
        attributes: dict[str, str | int | bool] = {"pagewise.prompt.index": prompt, "pagewise.engine.step": event.step}
        if isinstance(event, Scheduled):
            attributes.update({"pagewise.cached_tokens": event.cached_tokens, "pagewise.kv.blocks": event.num_blocks})
            self._child("pagewise.schedule", metrics.arrival_time, attributes).end(self._ns(event.time))
            return
        attributes["pagewise.choice.index"] = prompt * self._submit.params.n + event.sample
        if isinstance(event, PrefillChunk):
            attributes["pagewise.prefill.tokens"] = event.num_tokens
            attributes["pagewise.prefill.recompute"] = event.recompute
            self._child("pagewise.prefill", event.start, attributes).end(self._ns(event.end))
            return
        attributes["pagewise.preemption.mode"] = event.mode
        if isinstance(event, Resumed):
            attributes.update({"pagewise.cached_tokens": event.cached_tokens, "pagewise.kv.blocks": event.num_blocks})
        name = "pagewise.preempted" if isinstance(event, Preempted) else "pagewise.resumed"
        self._decode_or_execute(event.time).add_event(name, attributes, timestamp=self._ns(event.time))

    def _decode_or_execute(self, at: float) -> Span:
        """The span an event at `at` (engine clock) belongs to: the decode span once the first token is out."""
        if self._decode is not None and self._first_token is not None and at >= self._first_token:
            return self._decode
        return self._span

    def _child(self, name: str, start: float, attributes: dict[str, str | int | bool] | None = None) -> Span:
        context = trace.set_span_in_context(self._span)
        return tracing.tracer().start_span(name, context=context, attributes=attributes, start_time=self._ns(start))

    def _ns(self, engine_time: float) -> int:
        return int(engine_time * 1e9) + self._clock_offset_ns


def _failed(span: Span, error: ErrorInfo) -> None:
    span.set_attribute("error.type", str(error.code))
    span.set_status(StatusCode.ERROR, error.message)
