"""Tracing on, for every test here: spans go to an in-memory exporter, through the sampler production uses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ..harness import spans_in_memory


@pytest.fixture(autouse=True)
def spans() -> Iterator[InMemorySpanExporter]:
    """Autouse, so it is set up before the app fixtures (an app adds its instrumentation when it is created)."""
    with spans_in_memory() as exporter:
        yield exporter
