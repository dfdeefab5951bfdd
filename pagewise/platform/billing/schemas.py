"""Price bodies, for people: dollars per million tokens under the CLI's names (`input`, `cached_input`, `output`).

A price in a request is a JSON number or a decimal string with at most 6 decimals (a whole micro-dollar); the
service converts it exactly to the integer micro-dollars the table stores, and a response gives them back as
dollars. Request bodies reject unknown fields.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated

import msgspec

MAX_PRICE_MICROS = 1_000_000_000_000  # $1,000,000 per million tokens: costs stay far inside 64 bits
Dollars = float | str  # dollars per million tokens; checked and converted by `prices.to_micros`


class PriceCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A new price version for `model`, in dollars per million tokens. `cached_input` defaults to `input` and may
    not exceed it; a batch line pays `batch_percent` of it (default 50, OpenAI's batch discount); `effective_from`
    (no offset means UTC) defaults to now and may not lie in the past, so a new price never changes a cost already
    billed."""

    model: str
    input: Dollars
    output: Dollars
    cached_input: Dollars | None = None
    batch_percent: Annotated[int, msgspec.Meta(ge=0, le=100)] = 50
    effective_from: dt.datetime | None = None


class PriceOut(msgspec.Struct, kw_only=True):
    """A price version, in dollars per million tokens (exact: each is a whole number of micro-dollars)."""

    id: str
    model: str
    input: float
    cached_input: float
    output: float
    batch_percent: int  # the share of this price a batch line pays
    effective_from: dt.datetime
    created_at: dt.datetime
