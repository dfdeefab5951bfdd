"""A minimal OTLP/HTTP trace receiver: accepts ``POST /v1/traces`` (protobuf) on a free local port, keeps each body,
and decodes them on demand with ``opentelemetry-proto``. The tracing bench exports to it; the tests that check
what crosses process boundaries read its spans."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.proto.trace.v1.trace_pb2 import Span


@dataclass(slots=True)
class Received:
    """``endpoint`` is what ``OTEL_EXPORTER_OTLP_ENDPOINT`` takes; ``traces_url`` what an exporter built in code
    takes. ``bodies`` holds one body per accepted POST, undecoded (decoding costs nothing while a bench runs)."""

    endpoint: str
    bodies: list[bytes] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def traces_url(self) -> str:
        return f"{self.endpoint}/v1/traces"

    def snapshot(self) -> list[tuple[str, Span]]:
        """Every span received so far, with its service's name."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        with self.lock:
            bodies = list(self.bodies)
        spans: list[tuple[str, Span]] = []
        for body in bodies:
            for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
                service = _service_name(resource_spans.resource)
                for scope_spans in resource_spans.scope_spans:
                    spans.extend((service, span) for span in scope_spans.spans)
        return spans

    def summary(self) -> dict[str, Any]:
        """Posts, bytes, and spans by name."""
        with self.lock:
            num_posts, num_bytes = len(self.bodies), sum(map(len, self.bodies))
        names = Counter(span.name for _, span in self.snapshot())
        return {
            "posts": num_posts,
            "bytes": num_bytes,
            "spans": sum(names.values()),
            "spans_by_name": dict(sorted(names.items())),
        }


def _service_name(resource) -> str:  # noqa: ANN001 - a protobuf Resource
    return next((a.value.string_value for a in resource.attributes if a.key == "service.name"), "")


@contextmanager
def otlp_receiver() -> Iterator[Received]:
    """Listen until the block ends; each POST to ``/v1/traces`` is answered 200 with an empty export response."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    received = Received(f"http://127.0.0.1:{server.server_address[1]}")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the name http.server calls
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            with received.lock:
                received.bodies.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")  # an empty ExportTraceServiceResponse serializes to no bytes
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
            pass

    server.RequestHandlerClass = Handler
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield received
    finally:
        server.shutdown()
        server.server_close()
