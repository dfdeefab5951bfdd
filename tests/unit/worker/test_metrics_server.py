"""A worker's metrics endpoint: loopback by default, never on the network without the metrics token, and with a
token every scrape must carry it."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from pagewise.worker.metrics_server import MetricsExposureError, is_loopback, serve_metrics


@pytest.fixture
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("pagewise_test_tokens", "tokens", ["tenant"], registry=registry).labels("acme").inc(7)
    return registry


def scrape(port: int, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "worker.internal"])
def test_a_network_address_without_a_token_is_refused(registry, host: str) -> None:
    with pytest.raises(MetricsExposureError, match="PAGEWISE_METRICS_TOKEN"):
        serve_metrics(registry, host, 0, None)


def test_loopback_addresses() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.1", "example.com"))


def test_loopback_without_a_token_serves(registry) -> None:
    server = serve_metrics(registry, "127.0.0.1", 0, None)
    try:
        status, body = scrape(server.server_port)
        assert status == 200 and 'pagewise_test_tokens_total{tenant="acme"} 7.0' in body
    finally:
        server.shutdown()


def test_with_a_token_every_scrape_must_carry_it(registry) -> None:
    server = serve_metrics(registry, "127.0.0.1", 0, "s3cret")
    try:
        for token in (None, "wrong", "s3cret-but-longer"):
            status, body = scrape(server.server_port, token)
            assert status == 401 and "acme" not in body
        status, body = scrape(server.server_port, "s3cret")
        assert status == 200 and "acme" in body
    finally:
        server.shutdown()
