"""The dashboard's login session: a random id in an HttpOnly, SameSite=Strict cookie, the state on the server.

Invariants:
- The cookie carries only a random session id. The store keys the state by the id's SHA-256, so reading the
  store yields no usable cookie; the API key itself is never kept (only its id).
- Every request re-checks the key behind the session (`load_session`): once it is revoked or expired, or its
  tenant is suspended, the session is over — the dashboard never outlives what the API would accept.
- Each session has its own CSRF token, which every POST must echo (`csrf.py`).
- A session lasts `SESSION_TTL` from login at most; logout deletes it on the server, not just in the browser.

The state lives in the app's store registry under `STORE_NAME` (in memory unless the app registers a shared
store there, which API replicas behind one address need).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from typing import Literal

import msgspec
from litestar import Request
from litestar.datastructures import Cookie
from litestar.stores.base import Store
from sqlalchemy import select

from pagewise.platform.db.models import ApiKey, Tenant, utcnow
from pagewise.platform.keys.auth import DASHBOARD_PATH
from pagewise.platform.keys.schemas import key_status
from pagewise.platform.tenants.last_admin import ADMIN_SCOPE

SESSION_COOKIE = "pagewise_session"
STORE_NAME = "pagewise-dashboard-sessions"
SESSION_TTL = dt.timedelta(hours=8)

FlashKind = Literal["ok", "error"]


class Flash(msgspec.Struct, frozen=True):
    """A one-time message for the next page the admin sees (the outcome of a form)."""

    kind: FlashKind
    text: str


class SessionState(msgspec.Struct, kw_only=True):
    key_id: str
    key_label: str  # "tenant · key id": who is signed in, for the page header
    csrf_token: str
    expires_at: float  # unix seconds; the store forgets the state then too
    flashes: list[Flash] = []


class AdminSession(msgspec.Struct, kw_only=True):
    """A live session, as handlers see it."""

    store_key: str
    state: SessionState


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(SessionState)


def _store(request: Request) -> Store:
    return request.app.stores.get(STORE_NAME)


def _store_key(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


def session_cookie(request: Request, value: str, max_age: int) -> Cookie:
    """The session cookie (`max_age` 0 deletes it): HttpOnly, SameSite=Strict, scoped to the dashboard, and
    Secure whenever the dashboard is reached over HTTPS."""
    return Cookie(
        key=SESSION_COOKIE,
        value=value,
        path=DASHBOARD_PATH,
        max_age=max_age,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


async def open_session(request: Request, key_id: str, key_label: str) -> Cookie:
    """Start a session for the admin key `key_id` under a fresh id (never one the browser brought: no fixation)."""
    session_id = secrets.token_urlsafe(32)
    ttl = int(SESSION_TTL.total_seconds())
    state = SessionState(
        key_id=key_id, key_label=key_label, csrf_token=secrets.token_urlsafe(32), expires_at=utcnow().timestamp() + ttl
    )
    await _store(request).set(_store_key(session_id), _encoder.encode(state), expires_in=ttl)
    return session_cookie(request, session_id, ttl)


async def close_session(request: Request) -> Cookie:
    """Forget the request's session on the server; returns the cookie that clears it in the browser."""
    session_id = request.cookies.get(SESSION_COOKIE)
    if session_id:
        await _store(request).delete(_store_key(session_id))
    return session_cookie(request, "", 0)


async def load_session(request: Request) -> AdminSession | None:
    """The request's session while it and its key are valid; `None` otherwise (the stale state is deleted)."""
    session_id = request.cookies.get(SESSION_COOKIE)
    if not session_id:
        return None
    store_key = _store_key(session_id)
    raw = await _store(request).get(store_key)
    if raw is None:
        return None
    state = _decoder.decode(raw)
    if state.expires_at <= utcnow().timestamp() or not await _key_is_admin(request, state.key_id):
        await _store(request).delete(store_key)
        return None
    return AdminSession(store_key=store_key, state=state)


async def _key_is_admin(request: Request, key_id: str) -> bool:
    """The key would pass the API's checks for an admin route: active, `admin` scope, tenant active."""
    async with request.app.state.sessionmaker() as db:
        row = (
            await db.execute(
                select(ApiKey, Tenant).join(Tenant, Tenant.id == ApiKey.tenant_id).where(ApiKey.id == key_id)
            )
        ).first()
    if row is None:
        return False
    key, tenant = row.ApiKey, row.Tenant
    active = key_status(key.revoked_at, key.expires_at, utcnow()) == "active"
    return active and ADMIN_SCOPE in key.scopes and tenant.status == "active"


async def save_state(request: Request, session: AdminSession) -> None:
    """Write the session's state back, keeping its expiry."""
    remaining = int(session.state.expires_at - utcnow().timestamp())
    if remaining > 0:
        await _store(request).set(session.store_key, _encoder.encode(session.state), expires_in=remaining)


async def add_flash(request: Request, session: AdminSession, kind: FlashKind, text: str) -> None:
    session.state.flashes.append(Flash(kind, text))
    await save_state(request, session)


async def take_flashes(request: Request, session: AdminSession) -> list[Flash]:
    """The pending messages, each shown once."""
    flashes, session.state.flashes = session.state.flashes, []
    if flashes:
        await save_state(request, session)
    return flashes
