"""CSRF tokens. Every dashboard form that changes something is a POST carrying a token in `CSRF_FIELD`.

- Signed in: the token is the session's own (`SessionState.csrf_token`), a synchronizer token.
- The login form, before any session exists: a random token both in an HttpOnly, SameSite=Strict cookie scoped to
  the login path and in the form (double submit). Another site can neither read the cookie nor set it.

Tokens are compared in constant time. The GET search forms carry none: they change nothing, and a token in a
URL would leak into history and logs.
"""

from __future__ import annotations

import hmac
import secrets

from litestar import Request
from litestar.datastructures import Cookie

CSRF_FIELD = "csrf_token"
LOGIN_COOKIE = "pagewise_login_csrf"
LOGIN_TOKEN_TTL_S = 3600


def csrf_matches(expected: str | None, sent: str | None) -> bool:
    return bool(expected) and sent is not None and hmac.compare_digest(expected.encode(), sent.encode())


def login_token(request: Request) -> str:
    """The login form's token: the one the browser already holds, or a new one (set with `login_cookie`)."""
    return request.cookies.get(LOGIN_COOKIE) or secrets.token_urlsafe(32)


def login_cookie(request: Request, token: str, login_path: str, max_age: int = LOGIN_TOKEN_TTL_S) -> Cookie:
    """The login token's cookie (`max_age` 0 deletes it, once signed in)."""
    return Cookie(
        key=LOGIN_COOKIE,
        value=token,
        path=login_path,
        max_age=max_age,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
