"""`/admin/tenants/{tenant_id}/keys` (admin scope): create (key returned once), list, change limits, revoke, rotate.

`POST …/{key_id}/rotate` takes an optional body `{"grace_period_s": 0..604800}` (default 0: revoke at once).
`PATCH …/{key_id}` changes the key's own limits (`KeyUpdate`).
"""

from __future__ import annotations

from litestar import Controller, delete, get, patch, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, SkipValidation

from pagewise.platform.bodies import StrictBody, parse_body
from pagewise.platform.db.session import DbSession
from pagewise.platform.keys.auth import requires_scope
from pagewise.platform.keys.schemas import KeyCreate, KeyCreated, KeyOut, KeyRotate, KeyUpdate
from pagewise.platform.keys.service import KeyService, key_out

Keys = NamedDependency[SkipValidation[KeyService]]


def provide_key_service(db_session: DbSession) -> KeyService:
    return KeyService(db_session)


class KeyController(Controller):
    path = "/admin/tenants/{tenant_id:str}/keys"
    guards = [requires_scope("admin")]
    dependencies = {"keys": Provide(provide_key_service, sync_to_thread=False)}
    tags = ["admin"]

    @post("/")
    async def create_key(self, tenant_id: FromPath[str], data: StrictBody[KeyCreate], keys: Keys) -> KeyCreated:
        return await keys.create(tenant_id, parse_body(data, KeyCreate))

    @get("/")
    async def list_keys(self, tenant_id: FromPath[str], keys: Keys) -> list[KeyOut]:
        return [key_out(k) for k in await keys.list(tenant_id)]

    @patch("/{key_id:str}")
    async def update_key(
        self, tenant_id: FromPath[str], key_id: FromPath[str], data: StrictBody[KeyUpdate], keys: Keys
    ) -> KeyOut:
        return key_out(await keys.update(tenant_id, key_id, parse_body(data, KeyUpdate)))

    @delete("/{key_id:str}", status_code=200)
    async def revoke_key(self, tenant_id: FromPath[str], key_id: FromPath[str], keys: Keys) -> KeyOut:
        return key_out(await keys.revoke(tenant_id, key_id))

    @post("/{key_id:str}/rotate")
    async def rotate_key(
        self,
        tenant_id: FromPath[str],
        key_id: FromPath[str],
        keys: Keys,
        data: StrictBody[KeyRotate | None] = None,
    ) -> KeyCreated:
        body = parse_body(data, KeyRotate | None) or KeyRotate()
        return await keys.rotate(tenant_id, key_id, body.grace_period_s)
