"""The price table: versions are only added, and a request is priced by the version in effect when it finished.

Invariants: `price_in_effect(model, t)` is the version of `model` with the latest `effective_from` not after `t`, or
`None` (the model is free); a new version must take effect now or later, so it never changes a cost already
computed; every check runs before the insert, so a refused create writes nothing.
"""

from __future__ import annotations

import datetime as dt
from functools import partial
from typing import Protocol

from sqlalchemy import Connection, bindparam, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.billing.money import micros_for
from pagewise.platform.billing.schemas import MAX_PRICE_MICROS, PriceCreate, PriceOut
from pagewise.platform.db.database import Database
from pagewise.platform.db.ids import new_id
from pagewise.platform.db.models import ModelPrice, as_utc, utcnow
from pagewise.platform.errors import APIError, invalid_request
from pagewise.platform.quotas.quota_store import SpendRate
from pagewise.platform.tenants.names import clean_name

_PRICE_FIELDS = ("input_per_mtok_micros", "cached_input_per_mtok_micros", "output_per_mtok_micros")


class PriceTerms(Protocol):
    """What a request's cost is computed from: a `ModelPrice` or a row of `PRICE_IN_EFFECT`."""

    id: str
    input_per_mtok_micros: int
    cached_input_per_mtok_micros: int
    output_per_mtok_micros: int


def request_cost(price: PriceTerms | None, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
    """Micro-dollars for one request's tokens at `price` (cached prompt tokens at the cached price)."""
    if price is None:
        return 0
    product = (
        (prompt_tokens - cached_tokens) * price.input_per_mtok_micros
        + cached_tokens * price.cached_input_per_mtok_micros
        + completion_tokens * price.output_per_mtok_micros
    )
    return micros_for(product)


_PRICES = ModelPrice.__table__.c
# Built once with bind parameters: the request path runs it twice per request at most, and a statement object
# reused keeps SQLAlchemy from rebuilding its clauses and cache key each time.
PRICE_IN_EFFECT = (
    select(
        _PRICES.id, _PRICES.input_per_mtok_micros, _PRICES.cached_input_per_mtok_micros, _PRICES.output_per_mtok_micros
    )
    .where(_PRICES.model == bindparam("model"), _PRICES.effective_from <= bindparam("moment"))
    .order_by(_PRICES.effective_from.desc())
    .limit(1)
)


def price_in_effect(connection: Connection, model: str, moment: dt.datetime) -> PriceTerms | None:
    """The version of `model`'s price in effect at `moment`, or `None` if it had none yet."""
    return connection.execute(PRICE_IN_EFFECT, {"model": model, "moment": moment.astimezone(dt.UTC)}).first()


async def current_rate(database: Database, model: str, prompt_tokens: int) -> SpendRate | None:
    """How admission counts a request's reserved tokens as spend: at `model`'s price now (`None`: unpriced)."""
    price = await database.run(partial(price_in_effect, model=model, moment=utcnow()))
    if price is None:
        return None
    return SpendRate(prompt_tokens, price.input_per_mtok_micros, price.output_per_mtok_micros)


def price_out(price: ModelPrice) -> PriceOut:
    """The body for `price`; timestamps in UTC whichever database handed them back."""
    out = PriceOut(**{f: getattr(price, f) for f in PriceOut.__struct_fields__})
    out.effective_from, out.created_at = as_utc(out.effective_from), as_utc(out.created_at)
    return out


def _checked(data: PriceCreate, now: dt.datetime) -> dict[str, object]:
    """The row's values, or a 400 naming the first field that is wrong (bodies built in code, e.g. by the CLI,
    get the same checks as decoded ones)."""
    values: dict[str, object] = {
        "model": clean_name(data.model, param="model"),
        "input_per_mtok_micros": data.input_per_mtok_micros,
        "cached_input_per_mtok_micros": (
            data.input_per_mtok_micros if data.cached_input_per_mtok_micros is None
            else data.cached_input_per_mtok_micros
        ),
        "output_per_mtok_micros": data.output_per_mtok_micros,
    }
    for field in _PRICE_FIELDS:
        value = values[field]
        if not isinstance(value, int) or not 0 <= value <= MAX_PRICE_MICROS:
            raise invalid_request(
                f"{field} must be an integer number of micro-dollars from 0 to {MAX_PRICE_MICROS:,}; got {value!r}",
                param=field,
            )
    if values["cached_input_per_mtok_micros"] > values["input_per_mtok_micros"]:  # type: ignore[operator]
        raise invalid_request(
            "cached_input_per_mtok_micros must not exceed input_per_mtok_micros", param="cached_input_per_mtok_micros"
        )
    effective_from = now if data.effective_from is None else as_utc(data.effective_from).astimezone(dt.UTC)
    if effective_from < now:
        raise invalid_request(
            f"effective_from must not be in the past (a price never rewrites past bills); got"
            f" {effective_from.isoformat()}",
            param="effective_from",
        )
    values["effective_from"] = effective_from
    return values


class PriceService:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def create(self, data: PriceCreate) -> ModelPrice:
        """Add a price version; one for the same model and `effective_from` already there is a 409."""
        price = ModelPrice(id=new_id("price"), **_checked(data, utcnow()))
        self.session.add(price)
        try:
            await self.session.commit()
        except IntegrityError:
            await self.session.rollback()
            raise APIError(
                409,
                f"model '{price.model}' already has a price effective from {price.effective_from.isoformat()}",
                code="price_exists",
                param="effective_from",
            ) from None
        return price

    async def list(self, model: str | None = None) -> list[ModelPrice]:
        """Every version, by model, newest first."""
        query = select(ModelPrice).order_by(ModelPrice.model, ModelPrice.effective_from.desc())
        if model is not None:
            query = query.where(ModelPrice.model == model)
        return list((await self.session.scalars(query)).all())
