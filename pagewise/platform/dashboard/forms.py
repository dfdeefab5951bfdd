"""Dashboard form fields → the bodies the services take. Parsing only; the services check the values.

A form sends text. Here an empty quota means "no limit" (`None`), numbers may carry `,` or `_` separators,
times are `YYYY-MM-DDTHH:MM` in UTC (what `<input type="datetime-local">` sends), and anything unreadable is
a 400 naming the field — raised before any service is called, so a refused form changes nothing. A NUL in any
field is refused the same way (`refuse_nul`, run on every dashboard POST before its handler): PostgreSQL stores
no NUL in text, so an id holding one would otherwise be a 500 from the database.
"""

from __future__ import annotations

import datetime as dt
from typing import get_args

from litestar.datastructures import FormMultiDict

from pagewise.platform.errors import invalid_request
from pagewise.platform.keys.schemas import KeyCreate, Scope
from pagewise.platform.tenants.schemas import QUOTA_BOUNDS, TenantCreate, TenantStatus, TenantUpdate
from pagewise.serving.protocol import RequestStatus

SCOPES: tuple[str, ...] = get_args(Scope)
TENANT_STATUSES: tuple[str, ...] = get_args(TenantStatus)


def refuse_nul(form: FormMultiDict) -> None:
    """A 400 naming the first field (or field name) of ``form`` that holds a NUL character."""
    for field, value in form.multi_items():
        if "\x00" in field or (isinstance(value, str) and "\x00" in value):
            raise invalid_request(f"{field!r} contains a NUL character (U+0000)", param=field.replace("\x00", ""))


def text(form: FormMultiDict, field: str) -> str:
    value = form.get(field, "")
    return value.strip() if isinstance(value, str) else ""


def _whole_number(raw: str, field: str) -> int:
    try:
        return int(raw.replace(",", "").replace("_", ""))
    except ValueError:
        raise invalid_request(f"{field} must be a whole number; got {raw!r}", param=field) from None


def quota_fields(form: FormMultiDict) -> dict[str, int | None]:
    """Every quota of `QUOTA_BOUNDS`; an empty field is no limit."""
    return {f: (_whole_number(raw, f) if (raw := text(form, f)) else None) for f in QUOTA_BOUNDS}


def weight(form: FormMultiDict) -> float:
    raw = text(form, "weight")
    try:
        return float(raw)
    except ValueError:
        raise invalid_request(f"weight must be a number; got {raw!r}", param="weight") from None


def tenant_create(form: FormMultiDict) -> TenantCreate:
    return TenantCreate(name=text(form, "name"), weight=weight(form), **quota_fields(form))


def tenant_update(form: FormMultiDict) -> TenantUpdate:
    """Name, quotas and weight, all as the form shows them (the edit form always sends every field)."""
    return TenantUpdate(name=text(form, "name"), weight=weight(form), **quota_fields(form))


def tenant_status(form: FormMultiDict) -> TenantUpdate:
    status = text(form, "status")
    if status not in TENANT_STATUSES:
        raise invalid_request(f"status must be one of {', '.join(TENANT_STATUSES)}; got {status!r}", param="status")
    return TenantUpdate(status=status)


def utc_time(raw: str, field: str) -> dt.datetime | None:
    """`YYYY-MM-DDTHH:MM[:SS]` read as UTC; empty is `None`."""
    if not raw:
        return None
    try:
        moment = dt.datetime.fromisoformat(raw)
    except ValueError:
        raise invalid_request(f"{field} must be a time like 2026-12-01T08:30 (UTC); got {raw!r}", param=field) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)


def key_create(form: FormMultiDict) -> KeyCreate:
    scopes = [s for s in form.getall("scopes", []) if isinstance(s, str)]
    unknown = sorted(set(scopes) - set(SCOPES))
    if unknown:
        raise invalid_request(f"unknown scope {unknown[0]!r}; the scopes are {', '.join(SCOPES)}", param="scopes")
    return KeyCreate(
        name=text(form, "name"), scopes=scopes, expires_at=utc_time(text(form, "expires_at"), "expires_at")
    )


def grace_period(form: FormMultiDict) -> int:
    raw = text(form, "grace_period_s")
    return _whole_number(raw, "grace_period_s") if raw else 0


def request_status(raw: str) -> RequestStatus | None:
    if not raw:
        return None
    try:
        return RequestStatus(raw)
    except ValueError:
        statuses = ", ".join(s.value for s in RequestStatus)
        raise invalid_request(f"status must be one of {statuses}; got {raw!r}", param="status") from None
