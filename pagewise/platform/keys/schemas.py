"""API-key bodies. `KeyCreated` is the only body that ever carries a key, once.

Request bodies reject unknown fields. A key's `status` is derived, never stored: `revoked` once `revoked_at`
is set, else `expired` once `expires_at` has passed, else `active` — the same rule `authenticate` applies.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

import msgspec

from pagewise.platform.db.models import as_utc

Scope = Literal["inference", "admin"]
KeyStatus = Literal["active", "expired", "revoked"]

MAX_GRACE_PERIOD_S = 7 * 86400
GracePeriod = Annotated[int, msgspec.Meta(ge=0, le=MAX_GRACE_PERIOD_S)]


class KeyCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A new key. `expires_at` without a timezone is UTC; it must lie in the future."""

    name: str = ""
    scopes: list[Scope] = msgspec.field(default_factory=lambda: ["inference"])
    expires_at: dt.datetime | None = None


class KeyRotate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How long the rotated key keeps working; 0 revokes it at once."""

    grace_period_s: GracePeriod = 0


class KeyOut(msgspec.Struct, kw_only=True):
    id: str
    tenant_id: str
    name: str
    prefix: str
    scopes: list[str]
    status: KeyStatus
    created_at: dt.datetime
    last_used_at: dt.datetime | None
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None


class KeyCreated(KeyOut, kw_only=True):
    key: str


def key_status(revoked_at: dt.datetime | None, expires_at: dt.datetime | None, now: dt.datetime) -> KeyStatus:
    if revoked_at is not None:
        return "revoked"
    if expires_at is not None and as_utc(expires_at) <= now:
        return "expired"
    return "active"
