"""The OpenAPI document at `/schema`: what Litestar derives from the routes, plus what it cannot know.

Litestar documents its own `{status_code, detail}` body for errors; every error here leaves in OpenAI's shape
(`errors.py`), so each operation's error responses are replaced by that shape, and every route that needs a
key declares the bearer scheme. Done once per app, on the built document, before it is first served.

The document's page (`/schema`, also `/schema/swagger`) is Swagger UI, served from the files the
`swagger-ui-bundle-v2` package ships, under `/schema/assets`: it loads nothing from another host, so it works
offline. `/schema/openapi.json` and `/schema/openapi.yaml` serve the document itself.
"""

from __future__ import annotations

from litestar import Litestar, Router
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin, SwaggerRenderPlugin, YamlRenderPlugin
from litestar.openapi.spec import (
    Components,
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Reference,
    Schema,
    SecurityScheme,
)
from litestar.static_files import create_static_files_router
from swagger_ui_bundle import swagger_ui_path

from pagewise.platform.keys.auth import PUBLIC_PATHS

BEARER = "bearer"
SCHEMA_PATH = "/schema"
ASSETS = "assets"  # under SCHEMA_PATH
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
        "code": Schema(type=OpenAPIType.STRING, description="never null: OpenAI's code where it has one"),
    },
)
_ERROR_BODY = Schema(
    type=OpenAPIType.OBJECT,
    required=["error"],
    properties={"error": Reference(ref="#/components/schemas/ErrorDetail")},
    description="Every error, in OpenAI's shape.",
)


class LocalSwaggerRenderPlugin(SwaggerRenderPlugin):
    """Swagger UI whose script, styles and icon come from this server (`SCHEMA_PATH/ASSETS`), not a CDN."""

    def __init__(self) -> None:
        assets = f"{SCHEMA_PATH}/{ASSETS}"
        super().__init__(
            js_url=f"{assets}/swagger-ui-bundle.js",
            css_url=f"{assets}/swagger-ui.css",
            standalone_preset_js_url=f"{assets}/swagger-ui-standalone-preset.js",
            favicon=f"<link rel='icon' type='image/png' href='{assets}/favicon-32x32.png'>",
            path=["/", "/swagger"],
        )

    def receive_router(self, router: Router) -> None:
        super().receive_router(router)
        router.register(create_static_files_router(f"/{ASSETS}", directories=[swagger_ui_path], name="swagger-ui"))


def openapi_config() -> OpenAPIConfig:
    return OpenAPIConfig(
        title="pagewise",
        version="0.1.0",
        path=SCHEMA_PATH,
        render_plugins=[LocalSwaggerRenderPlugin(), JsonRenderPlugin(), YamlRenderPlugin()],
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
