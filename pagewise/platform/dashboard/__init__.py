"""The admin dashboard at `/admin/ui`: server-rendered pages over the admin services, for a browser.

What the app registers: `DASHBOARD_HANDLERS` (its routers) and `template_config()`. Every path under
`DASHBOARD_PATH` is skipped by the API-key middleware (`keys.auth.UNGUARDED_PATHS`); the dashboard guards itself:
the login page and the static files are public, every other page needs a signed-in admin (`access.require_admin`).
No page loads anything from another host: styles, the one script and the charts (inline SVG) are served here.
"""

from __future__ import annotations

from pathlib import Path

from litestar import Router
from litestar.datastructures import CacheControlHeader, ResponseHeader
from litestar.di import Provide
from litestar.static_files import create_static_files_router

from pagewise.platform.dashboard.access import EXCEPTION_HANDLERS, provide_admin, require_admin
from pagewise.platform.dashboard.controllers.exports import ExportPages
from pagewise.platform.dashboard.controllers.keys import KeyPages
from pagewise.platform.dashboard.controllers.login import LoginController, LogoutController
from pagewise.platform.dashboard.controllers.overview import OverviewController
from pagewise.platform.dashboard.controllers.requests import RequestPages
from pagewise.platform.dashboard.controllers.tenants import TenantPages
from pagewise.platform.dashboard.controllers.usage import UsagePages
from pagewise.platform.dashboard.controllers.workers import WorkerPages
from pagewise.platform.dashboard.templates import template_config
from pagewise.platform.keys.auth import DASHBOARD_PATH

STATIC_DIR = Path(__file__).parent / "static"
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_PAGE_OPTIONS = {
    "include_in_schema": False,
    "exception_handlers": EXCEPTION_HANDLERS,
    "response_headers": [ResponseHeader(name="content-security-policy", value=CONTENT_SECURITY_POLICY)],
    "cache_control": CacheControlHeader(no_store=True),  # pages show keys and usage: never cached
}

DASHBOARD_HANDLERS = [
    Router(DASHBOARD_PATH, route_handlers=[LoginController], **_PAGE_OPTIONS),
    Router(
        DASHBOARD_PATH,
        route_handlers=[
            OverviewController,
            TenantPages,
            KeyPages,
            UsagePages,
            RequestPages,
            WorkerPages,
            ExportPages,
            LogoutController,
        ],
        before_request=require_admin,
        dependencies={"admin": Provide(provide_admin, sync_to_thread=False)},
        **_PAGE_OPTIONS,
    ),
    create_static_files_router(f"{DASHBOARD_PATH}/static", directories=[STATIC_DIR], name="dashboard-static"),
]

__all__ = ["DASHBOARD_HANDLERS", "DASHBOARD_PATH", "template_config"]
