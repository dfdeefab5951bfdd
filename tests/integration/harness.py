"""A running app under test and the calls most tests make: create a tenant and a key as the admin."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from litestar import Litestar
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pagewise import tracing
from pagewise.platform.services import PlatformServices
from pagewise.tracing_export import build_provider

MODEL = "smollm2-135m-instruct"


@contextmanager
def spans_in_memory() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process while the block runs, every span kept in memory."""
    exporter = InMemorySpanExporter()
    provider = build_provider("pagewise-test")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    try:
        yield exporter
    finally:
        tracing.use(None)
        provider.shutdown()


@dataclass(slots=True)
class Platform:
    app: Litestar
    http: httpx.AsyncClient
    services: PlatformServices
    admin_key: str

    async def create_tenant(self, **quotas: Any) -> dict[str, Any]:
        body = {"name": f"tenant-{secrets.token_hex(4)}", **quotas}
        response = await self.http.post("/admin/tenants", json=body, headers=bearer(self.admin_key))
        assert response.status_code == 201, response.text
        return response.json()

    async def create_key(self, tenant_id: str, scopes: tuple[str, ...] = ("inference",)) -> str:
        response = await self.http.post(
            f"/admin/tenants/{tenant_id}/keys", json={"scopes": list(scopes)}, headers=bearer(self.admin_key)
        )
        assert response.status_code == 201, response.text
        return response.json()["key"]

    async def tenant_with_key(self, **quotas: Any) -> tuple[dict[str, Any], str]:
        tenant = await self.create_tenant(**quotas)
        return tenant, await self.create_key(tenant["id"])


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat_body(content: str = "Say hi", **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
        **extra,
    }


def asgi_scope(path: str, key: str) -> dict[str, Any]:
    """The ASGI scope of a JSON `POST path` with `key`: for tests that drive the app's receive/send themselves
    (to hang up at a chosen moment)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5000),
        "server": ("test", 80),
    }
