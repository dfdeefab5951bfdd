"""Rendering a signed-in page, and answering a form: Post/Redirect/Get with a one-time message.

A form's outcome — done, or refused with the service's own message — is a flash in the session followed by a
303 to the page to show next, so reloading that page never sends the form again.
"""

from __future__ import annotations

from typing import Any

from litestar import Request
from litestar.response import Redirect, Template

from pagewise.platform.dashboard.session import AdminSession, FlashKind, add_flash, take_flashes
from pagewise.platform.errors import APIError
from pagewise.platform.keys.auth import DASHBOARD_PATH

NAV = (
    ("overview", "Overview", ""),
    ("tenants", "Tenants", "/tenants"),
    ("keys", "Keys", "/keys"),
    ("usage", "Usage", "/usage"),
    ("requests", "Requests", "/requests"),
    ("workers", "Workers", "/workers"),
    ("exports", "Exports", "/exports"),
)


async def render(request: Request, admin: AdminSession, template: str, **context: Any) -> Template:
    """`template` with what every signed-in page needs: the nav, who is signed in, the CSRF token, the flashes."""
    return Template(
        template_name=template,
        context={
            "base": DASHBOARD_PATH,
            "nav": NAV,
            "who": admin.state.key_label,
            "csrf": admin.state.csrf_token,
            "flashes": await take_flashes(request, admin),
            **context,
        },
    )


async def back(request: Request, admin: AdminSession, path: str, text: str, kind: FlashKind = "ok") -> Redirect:
    """303 to `path` (under the dashboard) with `text` to show there once."""
    await add_flash(request, admin, kind, text)
    return Redirect(f"{DASHBOARD_PATH}{path}", status_code=303)


async def refused(request: Request, admin: AdminSession, path: str, error: APIError) -> Redirect:
    return await back(request, admin, path, error.message, "error")
