"""What every HTTP exchange gets at the edge, before any route code runs.

- A path or query string holding a NUL byte is a 400: no id or filter with one ever reaches a database
  (PostgreSQL refuses NUL in text, which would otherwise surface as a 500).
- Every response carries the security headers below; `/schema` pages keep scripts (the OpenAPI UIs need them),
  everything else is JSON or SSE and gets a `default-src 'none'` policy.
"""

from __future__ import annotations

import msgspec
from litestar.datastructures import MutableScopeHeaders
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from pagewise.platform.errors import ErrorBody, ErrorDetail

_SECURITY_HEADERS = {
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cross-origin-resource-policy": "same-origin",
}
_API_CSP = "default-src 'none'; frame-ancestors 'none'"
_SCHEMA_PREFIX = "/schema"
_NUL_BODY = msgspec.json.encode(
    ErrorBody(ErrorDetail("The path or query string contains a NUL byte", "invalid_request_error", None, "nul_byte"))
)
_NUL_START = {
    "type": "http.response.start",
    "status": 400,
    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(_NUL_BODY)).encode())],
}


def _has_nul(scope: Scope) -> bool:
    query = scope.get("query_string", b"").lower()
    return "\x00" in scope["path"] or b"%00" in query or b"\x00" in query


async def add_security_headers(message: Message, scope: Scope) -> None:
    """A `before_send` hook: security headers on every response start, without overriding a route's own."""
    if message["type"] != "http.response.start":
        return
    headers = MutableScopeHeaders.from_message(message)
    for name, value in _SECURITY_HEADERS.items():
        if name not in headers:
            headers[name] = value
    if not scope["path"].startswith(_SCHEMA_PREFIX) and "content-security-policy" not in headers:
        headers["content-security-policy"] = _API_CSP


def refuse_nul_bytes(app: ASGIApp) -> ASGIApp:
    """Route middleware: a NUL byte in the path or the query string is a 400 before auth or a handler runs."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _has_nul(scope):
            await send(_NUL_START)
            await send({"type": "http.response.body", "body": _NUL_BODY})
            return
        await app(scope, receive, send)

    return middleware
