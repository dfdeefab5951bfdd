"""Price bodies: integer micro-dollars per million tokens. Request bodies reject unknown fields."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

import msgspec

MAX_PRICE_MICROS = 1_000_000_000_000  # $1,000,000 per million tokens: costs stay far inside 64 bits
PriceMicros = Annotated[int, msgspec.Meta(ge=0, le=MAX_PRICE_MICROS)]


class PriceCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A new price version for `model`. `cached_input_per_mtok_micros` defaults to the input price and may not
    exceed it; `effective_from` (no offset means UTC) defaults to now and may not lie in the past, so a new
    price never changes a cost already billed."""

    model: str
    input_per_mtok_micros: PriceMicros
    output_per_mtok_micros: PriceMicros
    cached_input_per_mtok_micros: PriceMicros | None = None
    effective_from: dt.datetime | None = None


class PriceOut(msgspec.Struct, kw_only=True):
    id: str
    model: str
    input_per_mtok_micros: int
    cached_input_per_mtok_micros: int
    output_per_mtok_micros: int
    effective_from: dt.datetime
    created_at: dt.datetime
