"""Who may see a signed-in dashboard page, and what a refusal looks like.

`require_admin` runs before every signed-in handler: without a live session (`session.load_session`) the browser
is sent to the login page; a POST whose CSRF token does not match the session's is a 403, and one with a NUL in
a field a 400, before its handler runs, so it changes nothing. Errors render as an HTML page with the status
and the API's own message.
"""

from __future__ import annotations

from typing import TypeAlias

from litestar import Request, Response
from litestar.di import NamedDependency
from litestar.exceptions import HTTPException
from litestar.params import SkipValidation
from litestar.response import Redirect, Template

from pagewise.platform.dashboard.csrf import CSRF_FIELD, csrf_matches
from pagewise.platform.dashboard.forms import refuse_nul
from pagewise.platform.dashboard.session import AdminSession, load_session, session_cookie
from pagewise.platform.errors import APIError
from pagewise.platform.keys.auth import DASHBOARD_PATH

LOGIN_PATH = f"{DASHBOARD_PATH}/login"
CSRF_REFUSED = "The form's CSRF token is missing or does not match your session: reload the page and send it again."


class LoginRequired(Exception):
    """No live session: the browser goes to the login page."""


async def require_admin(request: Request) -> None:
    """`before_request` of the signed-in pages; leaves the session in `request.state.admin`."""
    session = await load_session(request)
    if session is None:
        raise LoginRequired
    if request.method == "POST":
        form = await request.form()
        if not csrf_matches(session.state.csrf_token, form.get(CSRF_FIELD)):
            raise APIError(403, CSRF_REFUSED, code="csrf_failed", param=CSRF_FIELD)
        refuse_nul(form)
    request.state.admin = session


Admin: TypeAlias = NamedDependency[SkipValidation[AdminSession]]
"""How a signed-in handler asks for its session (dependency `admin`)."""


def provide_admin(request: Request) -> AdminSession:
    return request.state.admin


def to_login(request: Request, _: LoginRequired) -> Response:
    """303 to the login page, clearing a stale session cookie."""
    return Redirect(LOGIN_PATH, status_code=303, cookies=[session_cookie(request, "", 0)])


def error_page(status_code: int, message: str) -> Template:
    return Template(
        template_name="error.html",
        context={"base": DASHBOARD_PATH, "status_code": status_code, "message": message},
        status_code=status_code,
    )


def api_error_page(_: Request, error: APIError) -> Template:
    return error_page(error.status_code, error.message)


def http_error_page(_: Request, error: HTTPException) -> Template:
    return error_page(error.status_code, error.detail)


EXCEPTION_HANDLERS = {LoginRequired: to_login, APIError: api_error_page, HTTPException: http_error_page}
