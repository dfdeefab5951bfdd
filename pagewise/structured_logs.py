"""Process-wide logging for `pagewise serve` and `pagewise worker`: one JSON object per line, or readable lines
when the stream is a terminal.

Invariants:
- A record logged while a span is current carries its `trace_id` and `span_id` (the same hex ids the traces and
  the `x-pagewise-trace-id` header show), so a request's lines are found from its trace and back.
- A line holds the record's message, level, logger, time and exception only: nothing here adds a request's body
  (and pagewise never logs one).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
from typing import TextIO

from opentelemetry import trace

_CONSOLE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def trace_fields() -> dict[str, str]:
    """`trace_id` and `span_id` of the current span; empty outside a (recorded) span."""
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return {}
    return {"trace_id": trace.format_trace_id(context.trace_id), "span_id": trace.format_span_id(context.span_id)}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **trace_fields(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class ConsoleFormatter(logging.Formatter):
    """`time LEVEL logger: message`, plus `[trace <id>]` inside a span."""

    def __init__(self) -> None:
        super().__init__(_CONSOLE_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = trace_fields()
        return f"{line} [trace {fields['trace_id']}]" if fields else line


QUIET_LOGGERS = ("alembic.runtime.plugins",)  # one INFO line per Alembic plugin at import


def configure_logging(
    level: str | int = "INFO", stream: TextIO | None = None, *, json_lines: bool | None = None
) -> None:
    """Send every logger's records to `stream` (stderr): JSON lines unless it is a terminal (or as `json_lines`
    says). Replaces the root logger's handlers, so calling it again reconfigures rather than duplicates."""
    stream = stream or sys.stderr
    if json_lines is None:
        json_lines = not stream.isatty()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if json_lines else ConsoleFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if isinstance(level, str) else level)
    for name in QUIET_LOGGERS:  # chatter about a library's own set-up, not about what pagewise does
        logging.getLogger(name).setLevel(logging.WARNING)
