"""API-key bodies. `KeyCreated` is the only body that ever carries a key, once."""

from __future__ import annotations

import datetime as dt
from typing import Literal

import msgspec

Scope = Literal["inference", "admin"]


class KeyCreate(msgspec.Struct, kw_only=True):
    name: str = ""
    scopes: list[Scope] = msgspec.field(default_factory=lambda: ["inference"])
    expires_at: dt.datetime | None = None


class KeyOut(msgspec.Struct, kw_only=True):
    id: str
    tenant_id: str
    name: str
    prefix: str
    scopes: list[str]
    created_at: dt.datetime
    last_used_at: dt.datetime | None
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None


class KeyCreated(KeyOut, kw_only=True):
    key: str
