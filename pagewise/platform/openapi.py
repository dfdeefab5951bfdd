"""The OpenAPI document at `/schema`: what Litestar derives from the routes, plus what it cannot know.

Litestar documents its own `{status_code, detail}` body for errors; every error here leaves in OpenAI's shape
(`errors.py`), so each operation's error responses are replaced by that shape, and every route that needs a
key declares the bearer scheme. Done once per app, on the built document, before it is first served.
"""

from __future__ import annotations

from litestar import Litestar
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import (
    Components,
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Reference,
    Schema,
    SecurityScheme,
)

from pagewise.platform.keys.auth import PUBLIC_PATHS

BEARER = "bearer"
_ERROR_STATUSES = {
    "400": "Invalid request: the message and `param` name the offending field.",
    "401": "Missing, malformed, unknown, revoked or expired API key.",
    "403": "The key lacks the scope this route needs, or its tenant is suspended.",
    "404": "No such resource for this tenant (another tenant's id is a 404 too).",
    "409": "Conflicts with the current state (a duplicate name, the last admin key).",
    "413": "The request body is larger than the server accepts.",
    "429": "A rate limit or budget refused the request; `Retry-After` says when to retry.",
}
_PUBLIC_ERRORS = ("400", "404")
_ERROR_DETAIL = Schema(
    type=OpenAPIType.OBJECT,
    required=["message", "type", "param", "code"],
    properties={
        "message": Schema(type=OpenAPIType.STRING),
        "type": Schema(type=OpenAPIType.STRING),
        "param": Schema(one_of=[Schema(type=OpenAPIType.STRING), Schema(type=OpenAPIType.NULL)]),
        "code": Schema(one_of=[Schema(type=OpenAPIType.STRING), Schema(type=OpenAPIType.NULL)]),
    },
)
_ERROR_BODY = Schema(
    type=OpenAPIType.OBJECT,
    required=["error"],
    properties={"error": Reference(ref="#/components/schemas/ErrorDetail")},
    description="Every error, in OpenAI's shape.",
)


def openapi_config() -> OpenAPIConfig:
    return OpenAPIConfig(
        title="pagewise",
        version="0.1.0",
        path="/schema",
        components=Components(
            security_schemes={
                BEARER: SecurityScheme(
                    type="http", scheme="bearer", description="An API key: `Authorization: Bearer pw_...`"
                )
            }
        ),
    )


def describe_errors(app: Litestar) -> None:
    """Put the real error shape and the bearer requirement on every operation of `app`'s document."""
    document = app.openapi_schema
    document.components.schemas = {
        **(document.components.schemas or {}),
        "ErrorDetail": _ERROR_DETAIL,
        "ErrorBody": _ERROR_BODY,
    }
    error = Reference(ref="#/components/schemas/ErrorBody")
    for path, item in (document.paths or {}).items():
        public = path.startswith(PUBLIC_PATHS)
        for method in ("get", "put", "post", "delete", "patch"):
            operation = getattr(item, method, None)
            if operation is None:
                continue
            responses = {k: v for k, v in (operation.responses or {}).items() if not k.startswith(("4", "5"))}
            for status in _PUBLIC_ERRORS if public else _ERROR_STATUSES:
                responses[status] = OpenAPIResponse(
                    description=_ERROR_STATUSES[status], content={"application/json": OpenAPIMediaType(schema=error)}
                )
            operation.responses = responses
            if not public:
                operation.security = [{BEARER: []}]
