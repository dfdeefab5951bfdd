"""Signing in and out. Only an admin-scope key of an active tenant signs in; it is checked exactly as the API
checks a bearer key (`keys.auth.authenticate`), and never echoed back or stored — the session keeps its id."""

from __future__ import annotations

from litestar import Controller, Request, get, post
from litestar.response import Redirect, Template

from pagewise.platform.dashboard.access import LOGIN_PATH
from pagewise.platform.dashboard.csrf import CSRF_FIELD, LOGIN_COOKIE, csrf_matches, login_cookie, login_token
from pagewise.platform.dashboard.forms import refuse_nul, text
from pagewise.platform.dashboard.session import close_session, load_session, open_session
from pagewise.platform.errors import APIError
from pagewise.platform.keys.auth import DASHBOARD_PATH, authenticate, check_scope, client_address
from pagewise.platform.services import Services
from pagewise.platform.tenants.last_admin import ADMIN_SCOPE

NOT_ADMIN = "This key has no admin scope: the dashboard needs an admin key (an inference key only calls the API)."


def login_page(request: Request, message: str | None = None, status_code: int = 200) -> Template:
    """The login form with its double-submit CSRF token (cookie and hidden field)."""
    token = login_token(request)
    return Template(
        template_name="login.html",
        context={"base": DASHBOARD_PATH, "csrf": token, "message": message},
        status_code=status_code,
        cookies=[login_cookie(request, token, LOGIN_PATH)],
    )


class LoginController(Controller):
    path = "/login"

    @get("/")
    async def show(self, request: Request) -> Template | Redirect:
        if await load_session(request) is not None:
            return Redirect(f"{DASHBOARD_PATH}/", status_code=303)
        return login_page(request)

    @post("/", status_code=303)
    async def sign_in(self, request: Request, services: Services) -> Template | Redirect:
        form = await request.form()
        if not csrf_matches(request.cookies.get(LOGIN_COOKIE), form.get(CSRF_FIELD)):
            return login_page(request, "The login form expired: please sign in again.", 403)
        try:
            refuse_nul(form)
            bearer = f"Bearer {text(form, 'api_key')}"
            principal = await authenticate(services.database, bearer, services.auth_failures, client_address(request))
            check_scope(principal, ADMIN_SCOPE)
        except APIError as error:
            message = NOT_ADMIN if error.code == "insufficient_scope" else error.message
            return login_page(request, message, error.status_code)
        label = f"{principal.tenant_name} · {principal.key_id}"
        cookie = await open_session(request, principal.key_id, label)
        return Redirect(
            f"{DASHBOARD_PATH}/", status_code=303, cookies=[cookie, login_cookie(request, "", LOGIN_PATH, max_age=0)]
        )


class LogoutController(Controller):
    path = "/logout"

    @post("/", status_code=303)
    async def sign_out(self, request: Request) -> Redirect:
        return Redirect(LOGIN_PATH, status_code=303, cookies=[await close_session(request)])
