"""Tenant bodies. In updates an absent field is left alone and `null` means "no limit"."""

from __future__ import annotations

import datetime as dt
from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

TenantStatus = Literal["active", "suspended"]


class TenantCreate(msgspec.Struct, kw_only=True):
    """A new tenant; each quota is `null` for unlimited and defaults to a conservative value."""

    name: str
    requests_per_minute: int | None = 600
    tokens_per_minute: int | None = 200_000
    monthly_token_budget: int | None = None
    max_concurrent_requests: int | None = 16
    max_tokens_per_request: int | None = 4096
    max_n: int | None = 8


class TenantUpdate(msgspec.Struct, kw_only=True):
    name: str | UnsetType = UNSET
    status: TenantStatus | UnsetType = UNSET
    requests_per_minute: int | None | UnsetType = UNSET
    tokens_per_minute: int | None | UnsetType = UNSET
    monthly_token_budget: int | None | UnsetType = UNSET
    max_concurrent_requests: int | None | UnsetType = UNSET
    max_tokens_per_request: int | None | UnsetType = UNSET
    max_n: int | None | UnsetType = UNSET


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
    created_at: dt.datetime
    updated_at: dt.datetime
