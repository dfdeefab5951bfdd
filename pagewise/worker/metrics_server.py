"""A worker's Prometheus endpoint: `GET /metrics` from its own registry, behind the API's metrics token.

Invariants: it listens on loopback unless told otherwise; a non-loopback address without a metrics token is
refused at start (`MetricsExposureError`), since the registry holds per-tenant counters; with a token every
request must carry `Authorization: Bearer <token>` (compared in constant time) or gets a 401, and nothing of the
registry is read for a refused request.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

LOOPBACK = "127.0.0.1"


class MetricsExposureError(ValueError):
    """The metrics endpoint would expose per-tenant counters to the network without a token."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, token: str | None) -> None:
    """Raise `MetricsExposureError` for a non-loopback `host` without a token."""
    if token is None and not is_loopback(host):
        raise MetricsExposureError(
            f"--metrics-host {host} would serve per-tenant metrics to the network without authentication; "
            "set PAGEWISE_METRICS_TOKEN (scrapers then send it as a bearer token) or keep the default 127.0.0.1"
        )


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


def guarded_app(registry: CollectorRegistry, token: str | None) -> Callable[..., Iterable[bytes]]:
    """The registry's WSGI app, answering 401 to a request without `Bearer <token>` when `token` is set."""
    metrics = make_wsgi_app(registry)
    expected = None if token is None else _digest(token)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if expected is not None:
            scheme, _, given = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(_digest(given.strip()), expected):
                start_response(
                    "401 Unauthorized",
                    [("Content-Type", "text/plain"), ("WWW-Authenticate", 'Bearer realm="pagewise-metrics"')],
                )
                return [b"a bearer token (PAGEWISE_METRICS_TOKEN) is required\n"]
        return metrics(environ, start_response)

    return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Scrapes every few seconds would flood the worker's log."""


def serve_metrics(registry: CollectorRegistry, host: str, port: int, token: str | None) -> ThreadingWSGIServer:
    """Serve `registry` on `host:port` from a daemon thread; the server is returned (its `server_port` is the
    port bound, useful with port 0). Raises `MetricsExposureError` for a non-loopback host without a token."""
    check_exposure(host, token)
    server = make_server(host, port, guarded_app(registry, token), ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="pagewise-metrics", daemon=True).start()
    return server
