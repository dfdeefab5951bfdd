"""Tracing on, for every test here: spans go to an in-memory exporter, through the sampler production uses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pagewise import tracing
from pagewise.tracing_export import build_provider


@pytest.fixture(autouse=True)
def spans() -> Iterator[InMemorySpanExporter]:
    """Autouse, so it is set up before the app fixtures (an app adds its instrumentation when it is created)."""
    exporter = InMemorySpanExporter()
    provider = build_provider("pagewise-test")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    yield exporter
    tracing.use(None)
    provider.shutdown()
