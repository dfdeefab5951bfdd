"""Bodies of the adapters API (`/v1/adapters`, `/admin/tenants/{id}/adapters`)."""

from __future__ import annotations

from typing import Literal

import msgspec

from pagewise.platform.db.models import Adapter, as_utc

AdapterStatus = Literal["active", "disabled"]


class AdapterObject(msgspec.Struct, kw_only=True):
    """A tenant's adapter. `model` is the name requests use for it (`<base_model>:<name>`); `digest` the sha256
    content address of its two files."""

    id: str
    name: str
    model: str
    base_model: str
    digest: str
    rank: int
    target_modules: list[str]
    bytes: int
    status: str
    created_at: int  # Unix seconds
    object: Literal["adapter"] = "adapter"


class AdapterList(msgspec.Struct, kw_only=True):
    """A page, newest first; pass `last_id` as `after` for the next page while `has_more`."""

    data: list[AdapterObject]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"


class AdapterUpdate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`disabled`: requests under the adapter are refused (it stays listed); `active`: they run again."""

    status: AdapterStatus


class AdapterDeleted(msgspec.Struct, kw_only=True):
    id: str
    deleted: bool = True
    object: Literal["adapter"] = "adapter"


def model_name(base_model: str, adapter_name: str) -> str:
    """What a request names to run under an adapter: `<base model>:<adapter name>` (neither holds a `:`)."""
    return f"{base_model}:{adapter_name}"


def adapter_object(row: Adapter) -> AdapterObject:
    return AdapterObject(
        id=row.id,
        name=row.name,
        model=model_name(row.base_model, row.name),
        base_model=row.base_model,
        digest=row.digest,
        rank=row.rank,
        target_modules=list(row.target_modules),
        bytes=row.bytes,
        status=row.status,
        created_at=int(as_utc(row.created_at).timestamp()),
    )
