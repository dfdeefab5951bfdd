"""Log lines: JSON with the current span's ids off a terminal, readable lines on one."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry.trace import SpanKind, format_span_id, format_trace_id

from pagewise import tracing
from pagewise.structured_logs import configure_logging
from pagewise.tracing_export import build_provider


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


@pytest.fixture
def traced() -> Iterator[None]:
    tracing.use(build_provider("unit"))
    yield
    tracing.use(None)


def test_off_a_terminal_each_record_is_one_json_line_with_the_span_ids(restore_logging: None, traced: None) -> None:
    stream = io.StringIO()
    configure_logging("INFO", stream)
    log = logging.getLogger("pagewise.test")
    log.info("outside")
    with tracing.tracer().start_as_current_span("request", kind=SpanKind.SERVER) as span:
        log.warning("inside %s", "a span")
    outside, inside = (json.loads(line) for line in stream.getvalue().splitlines())
    assert outside.keys() == {"time", "level", "logger", "message"}
    assert inside["message"] == "inside a span" and inside["level"] == "warning" and inside["logger"] == "pagewise.test"
    context = span.get_span_context()
    assert inside["trace_id"] == format_trace_id(context.trace_id)
    assert inside["span_id"] == format_span_id(context.span_id)


def test_an_exception_stays_inside_its_json_line(restore_logging: None) -> None:
    stream = io.StringIO()
    configure_logging("INFO", stream)
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("pagewise.test").exception("failed")
    (line,) = stream.getvalue().splitlines()
    assert "ValueError: boom" in json.loads(line)["exception"]


def test_on_a_terminal_lines_are_readable_and_name_the_trace(restore_logging: None, traced: None) -> None:
    stream = _Terminal()
    configure_logging("DEBUG", stream)
    with tracing.tracer().start_as_current_span("request", kind=SpanKind.SERVER) as span:
        logging.getLogger("pagewise.test").debug("hello")
    line = stream.getvalue().strip()
    assert " DEBUG pagewise.test: hello [trace " in line
    assert line.endswith(f"{format_trace_id(span.get_span_context().trace_id)}]")


def test_a_process_start_prints_no_alembic_plugin_lines() -> None:
    """`pagewise worker` and `serve` used to open with seven INFO lines of Alembic's plugin set-up."""
    import subprocess
    import sys

    script = (
        "from pagewise.structured_logs import configure_logging\n"
        "configure_logging('INFO')\n"
        "from pagewise.platform.db.migrate import upgrade_head\n"
        "import logging; logging.getLogger('pagewise').info('started')\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert "started" in run.stderr
    assert "alembic.runtime.plugins" not in run.stderr
