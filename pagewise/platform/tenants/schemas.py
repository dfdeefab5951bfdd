"""Tenant bodies. In updates an absent field is left alone; a quota set to `null` means "no limit".

The quota fields and their bounds are declared once, here: `QUOTA_BOUNDS` is read from `TenantCreate`'s
annotations, and the service applies it to bodies built in code (the CLI) that no decoder checked; it does the
same with `MAX_WEIGHT`, the bound of `Weight`.
Bodies reject unknown fields, so a misspelt quota (`rpm`) is a 400, never a silent no-op.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, UnsetType

TenantStatus = Literal["active", "suspended"]

INT32_MAX = 2_147_483_647  # the `Integer` columns
INT64_MAX = 9_223_372_036_854_775_807  # the `BigInteger` column

Count = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
"""A per-minute limit; 0 blocks the dimension."""
PositiveCount = Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)]
TokenBudget = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
SpendBudget = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
"""A monthly spend budget in integer micro-dollars (1 USD = 1,000,000)."""
MAX_WEIGHT = 100.0
Weight = Annotated[float, msgspec.Meta(gt=0, le=MAX_WEIGHT)]
"""A tenant's scheduling weight (its tier): while tenants are all backlogged, each gets engine time in
proportion to its weight (2 gets twice the share of 1). Finite, above 0, at most `MAX_WEIGHT`; never null."""


class TenantCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A new tenant; each quota is `null` for unlimited and defaults to a conservative value; weight 1 is
    the base tier."""

    name: str
    requests_per_minute: Count | None = 600
    tokens_per_minute: Count | None = 200_000
    monthly_token_budget: TokenBudget | None = None
    max_concurrent_requests: PositiveCount | None = 16
    max_tokens_per_request: PositiveCount | None = 4096
    max_n: PositiveCount | None = 8
    weight: Weight = 1.0
    monthly_spend_budget_micros: SpendBudget | None = None


class TenantUpdate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str | UnsetType = UNSET
    status: TenantStatus | UnsetType = UNSET
    requests_per_minute: Count | None | UnsetType = UNSET
    tokens_per_minute: Count | None | UnsetType = UNSET
    monthly_token_budget: TokenBudget | None | UnsetType = UNSET
    max_concurrent_requests: PositiveCount | None | UnsetType = UNSET
    max_tokens_per_request: PositiveCount | None | UnsetType = UNSET
    max_n: PositiveCount | None | UnsetType = UNSET
    weight: Weight | UnsetType = UNSET
    monthly_spend_budget_micros: SpendBudget | None | UnsetType = UNSET


class TenantOut(msgspec.Struct, kw_only=True):
    id: str
    name: str
    status: TenantStatus
    requests_per_minute: int | None
    tokens_per_minute: int | None
    monthly_token_budget: int | None
    max_concurrent_requests: int | None
    max_tokens_per_request: int | None
    max_n: int | None
    weight: float
    monthly_spend_budget_micros: int | None
    created_at: dt.datetime
    updated_at: dt.datetime


def _quota_bounds() -> dict[str, tuple[int, int]]:
    """(minimum, maximum) of every bounded integer field of `TenantCreate`: its quota fields."""
    bounds = {}
    for field in msgspec.inspect.type_info(TenantCreate).fields:
        for kind in getattr(field.type, "types", (field.type,)):
            if isinstance(kind, msgspec.inspect.IntType) and kind.ge is not None and kind.le is not None:
                bounds[field.name] = (kind.ge, kind.le)
    return bounds


QUOTA_BOUNDS = _quota_bounds()
"""Quota field → (minimum, maximum); `None` (no limit) is always allowed as well."""
