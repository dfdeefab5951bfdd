"""API keys: create (the key is shown on the response page, once, and never again), rotate, revoke, and each
key's usage — through `KeyService`, which refuses revoking the last working admin key."""

from __future__ import annotations

import datetime as dt
from urllib.parse import quote

from litestar import Controller, Request, get, post
from litestar.params import FromPath
from litestar.response import Redirect, Template

from pagewise.platform.dashboard.access import Admin
from pagewise.platform.dashboard.forms import SCOPES, grace_period, key_create, text
from pagewise.platform.dashboard.key_usage import usage_by_key
from pagewise.platform.dashboard.pages import back, refused, render
from pagewise.platform.db.session import DbSession
from pagewise.platform.errors import APIError
from pagewise.platform.keys.schemas import KeyCreated
from pagewise.platform.keys.service import KeyService, key_out
from pagewise.platform.tenants.service import TenantService

KEY_USAGE_WINDOW = dt.timedelta(days=30)


def _return_path(came_from: str, tenant_id: str) -> str:
    """Where a key action returns: the tenant's page or the keys list (never a path the form names itself)."""
    return f"/tenants/{quote(tenant_id, safe='')}" if came_from == "tenant" else "/keys"


class KeyPages(Controller):
    @get("/keys")
    async def list_keys(self, request: Request, admin: Admin, db_session: DbSession) -> Template:
        tenants = await TenantService(db_session).list()
        since = dt.datetime.now(dt.UTC) - KEY_USAGE_WINDOW
        return await render(
            request,
            admin,
            "keys.html",
            page="keys",
            keys=[key_out(k) for k in await KeyService(db_session).list()],
            tenant_names={t.id: t.name for t in tenants},
            tenants=tenants,
            scopes=SCOPES,
            usage=await usage_by_key(db_session, since),
            usage_days=KEY_USAGE_WINDOW.days,
        )

    @post("/keys")
    async def create(self, request: Request, admin: Admin, db_session: DbSession) -> Template | Redirect:
        form = await request.form()
        tenant_id = text(form, "tenant_id")
        try:
            created = await KeyService(db_session).create(tenant_id, key_create(form))
        except APIError as error:
            return await refused(request, admin, _return_path(text(form, "from"), tenant_id), error)
        return await _show_once(request, admin, db_session, created, "Created")

    @post("/tenants/{tenant_id:str}/keys/{key_id:str}/rotate")
    async def rotate(
        self, request: Request, admin: Admin, db_session: DbSession, tenant_id: FromPath[str], key_id: FromPath[str]
    ) -> Template | Redirect:
        form = await request.form()
        try:
            created = await KeyService(db_session).rotate(tenant_id, key_id, grace_period(form))
        except APIError as error:
            return await refused(request, admin, _return_path(text(form, "from"), tenant_id), error)
        return await _show_once(request, admin, db_session, created, f"Rotated {key_id} into")

    @post("/tenants/{tenant_id:str}/keys/{key_id:str}/revoke")
    async def revoke(
        self, request: Request, admin: Admin, db_session: DbSession, tenant_id: FromPath[str], key_id: FromPath[str]
    ) -> Redirect:
        path = _return_path(text(await request.form(), "from"), tenant_id)
        try:
            await KeyService(db_session).revoke(tenant_id, key_id)
        except APIError as error:
            return await refused(request, admin, path, error)
        return await back(request, admin, path, f"Revoked key {key_id}.")


async def _show_once(request: Request, admin: Admin, db_session: DbSession, created: KeyCreated, verb: str) -> Template:
    """The one page that ever shows the key: the answer to the POST itself, so nothing stores the key."""
    tenant = await TenantService(db_session).get(created.tenant_id)
    return await render(request, admin, "key_created.html", page="keys", created=created, tenant=tenant, verb=verb)
