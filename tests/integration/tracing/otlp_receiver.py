"""A minimal OTLP/HTTP trace receiver for tests: accepts `POST /v1/traces` (protobuf) and keeps every span with
its service's name, decoded with `opentelemetry-proto`."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span


@dataclass(slots=True)
class Received:
    endpoint: str
    spans: list[tuple[str, Span]] = field(default_factory=list)  # (service.name, span)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> list[tuple[str, Span]]:
        with self.lock:
            return list(self.spans)


def _service_name(resource) -> str:  # noqa: ANN001 - a protobuf Resource
    return next((a.value.string_value for a in resource.attributes if a.key == "service.name"), "")


@contextmanager
def otlp_receiver() -> Iterator[Received]:
    """Listen on a free local port until the block ends; `endpoint` is what `OTEL_EXPORTER_OTLP_ENDPOINT` takes."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    received = Received(f"http://127.0.0.1:{server.server_address[1]}")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the name http.server calls
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            request = ExportTraceServiceRequest.FromString(body)
            with received.lock:
                for resource_spans in request.resource_spans:
                    service = _service_name(resource_spans.resource)
                    for scope_spans in resource_spans.scope_spans:
                        received.spans.extend((service, span) for span in scope_spans.spans)
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

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
