"""API-key bodies. `KeyCreated` is the only body that ever carries a key, once.

Request bodies reject unknown fields. A key's `status` is derived, never stored: `revoked` once `revoked_at`
is set, else `expired` once `expires_at` has passed, else `active` — the same rule `authenticate` applies.
A key's limits (`KeyLimits`, declared once here) apply on top of its tenant's; `null` means none of its own,
`allowed_models` `null` allows every model, and `priority_class` (`interactive`, `batch`; `null`: `interactive`)
is the best priority class its requests run at: a request asking for a better `priority` runs at the class's.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, UnsetType

from pagewise.platform.db.models import as_utc
from pagewise.platform.tenants.schemas import Count, SpendBudget, TokenBudget

Scope = Literal["inference", "admin"]
KeyStatus = Literal["active", "expired", "revoked"]

MAX_GRACE_PERIOD_S = 7 * 86400
GracePeriod = Annotated[int, msgspec.Meta(ge=0, le=MAX_GRACE_PERIOD_S)]
MAX_ALLOWED_MODELS = 100
AllowedModels = Annotated[list[str], msgspec.Meta(min_length=1, max_length=MAX_ALLOWED_MODELS)]
PriorityClass = Literal["interactive", "batch"]  # the names of `pagewise.engine.limits.PRIORITY_CLASSES`


class KeyLimits(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A key's own limits, on top of its tenant's (concurrency stays the tenant's)."""

    requests_per_minute: Count | None = None
    tokens_per_minute: Count | None = None
    monthly_token_budget: TokenBudget | None = None
    monthly_spend_budget_micros: SpendBudget | None = None
    allowed_models: AllowedModels | None = None
    priority_class: PriorityClass | None = None


KEY_LIMIT_FIELDS = KeyLimits.__struct_fields__


class KeyCreate(KeyLimits, kw_only=True, forbid_unknown_fields=True):
    """A new key. `expires_at` without a timezone is UTC; it must lie in the future."""

    name: str = ""
    scopes: list[Scope] = msgspec.field(default_factory=lambda: ["inference"])
    expires_at: dt.datetime | None = None


class KeyUpdate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A change to a key's limits: an absent field is left alone, `null` removes the key's own limit."""

    requests_per_minute: Count | None | UnsetType = UNSET
    tokens_per_minute: Count | None | UnsetType = UNSET
    monthly_token_budget: TokenBudget | None | UnsetType = UNSET
    monthly_spend_budget_micros: SpendBudget | None | UnsetType = UNSET
    allowed_models: AllowedModels | None | UnsetType = UNSET
    priority_class: PriorityClass | None | UnsetType = UNSET


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
    requests_per_minute: int | None
    tokens_per_minute: int | None
    monthly_token_budget: int | None
    monthly_spend_budget_micros: int | None
    allowed_models: list[str] | None
    priority_class: str | None


class KeyCreated(KeyOut, kw_only=True):
    key: str


def key_status(revoked_at: dt.datetime | None, expires_at: dt.datetime | None, now: dt.datetime) -> KeyStatus:
    if revoked_at is not None:
        return "revoked"
    if expires_at is not None and as_utc(expires_at) <= now:
        return "expired"
    return "active"
