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

from pagewise.platform.billing.schemas import MAX_PRICE_MICROS, Dollars, PriceCreate, PriceOut
from pagewise.platform.db.database import Database
from pagewise.platform.db.ids import new_id
from pagewise.platform.db.models import ModelPrice, as_utc, utcnow
from pagewise.platform.errors import APIError, invalid_request
from pagewise.platform.tenants.names import clean_name
from pagewise.serving.money import MICROS_PER_DOLLAR, micros_for, parse_dollars
from pagewise.serving.protocol import SpendRate


class PriceTerms(Protocol):
    """What a request's cost is computed from: a `ModelPrice` or a row of `PRICE_IN_EFFECT`."""

    id: str
    input_per_mtok_micros: int
    cached_input_per_mtok_micros: int
    output_per_mtok_micros: int
    batch_percent: int


def request_cost(
    price: PriceTerms | None, prompt_tokens: int, cached_tokens: int, completion_tokens: int, *, batch: bool = False
) -> int:
    """Micro-dollars for one request's tokens at `price` (cached prompt tokens at the cached price); a batch
    line's at the price's `batch_percent` of it."""
    if price is None:
        return 0
    product = (
        (prompt_tokens - cached_tokens) * price.input_per_mtok_micros
        + cached_tokens * price.cached_input_per_mtok_micros
        + completion_tokens * price.output_per_mtok_micros
    )
    return micros_for(product * price.batch_percent // 100 if batch else product)


_PRICES = ModelPrice.__table__.c
# Built once with bind parameters: the request path runs it twice per request at most, and a statement object
# reused keeps SQLAlchemy from rebuilding its clauses and cache key each time.
PRICE_IN_EFFECT = (
    select(
        _PRICES.id,
        _PRICES.input_per_mtok_micros,
        _PRICES.cached_input_per_mtok_micros,
        _PRICES.output_per_mtok_micros,
        _PRICES.batch_percent,
    )
    .where(_PRICES.model == bindparam("model"), _PRICES.effective_from <= bindparam("moment"))
    .order_by(_PRICES.effective_from.desc())
    .limit(1)
)


def price_in_effect(connection: Connection, model: str, moment: dt.datetime) -> PriceTerms | None:
    """The version of `model`'s price in effect at `moment`, or `None` if it had none yet."""
    return connection.execute(PRICE_IN_EFFECT, {"model": model, "moment": moment.astimezone(dt.UTC)}).first()


def first_price_in_effect(
    connection: Connection, models: tuple[str, ...], moment: dt.datetime
) -> PriceTerms | None:
    """The price in effect at `moment` of the first of `models` that has one: a request under a tenant's adapter
    is priced by the adapter's own price (keyed by its id) where the operator set one, else by its base model's."""
    for model in models:
        price = price_in_effect(connection, model, moment)
        if price is not None:
            return price
    return None


async def current_rate(database: Database, models: tuple[str, ...], prompt_tokens: int) -> SpendRate | None:
    """How admission counts a request's reserved tokens as spend: at the price now of the first of `models` that
    has one (`None`: unpriced)."""
    price = await database.run(partial(first_price_in_effect, models=models, moment=utcnow()))
    if price is None:
        return None
    return SpendRate(prompt_tokens, price.input_per_mtok_micros, price.output_per_mtok_micros)


def price_out(price: ModelPrice) -> PriceOut:
    """The body for `price`, in dollars; timestamps in UTC whichever database handed them back."""
    return PriceOut(
        id=price.id,
        model=price.model,
        input=price.input_per_mtok_micros / MICROS_PER_DOLLAR,
        cached_input=price.cached_input_per_mtok_micros / MICROS_PER_DOLLAR,
        output=price.output_per_mtok_micros / MICROS_PER_DOLLAR,
        batch_percent=price.batch_percent,
        effective_from=as_utc(price.effective_from),
        created_at=as_utc(price.created_at),
    )


def to_micros(value: Dollars, field: str) -> int:
    """Dollars per million tokens (a JSON number or a decimal string) as exact micro-dollars, or a 400 naming
    `field`. A number is read by its shortest decimal form (`0.15`, not the binary float's expansion), so any
    amount with at most 6 decimals converts exactly."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise invalid_request(f"{field} must be a number of dollars per million tokens; got {value!r}", param=field)
    try:
        micros = parse_dollars(value if isinstance(value, str) else repr(value), field)
    except ValueError as error:
        raise invalid_request(str(error), param=field) from None
    if not 0 <= micros <= MAX_PRICE_MICROS:
        raise invalid_request(
            f"{field} must be dollars per million tokens from 0 to {MAX_PRICE_MICROS // MICROS_PER_DOLLAR:,};"
            f" got {value!r}",
            param=field,
        )
    return micros


def _checked(data: PriceCreate, now: dt.datetime) -> dict[str, object]:
    """The row's values, or a 400 naming the first field that is wrong (bodies built in code, e.g. by the CLI,
    get the same checks as decoded ones)."""
    input_micros = to_micros(data.input, "input")
    cached_micros = input_micros if data.cached_input is None else to_micros(data.cached_input, "cached_input")
    if cached_micros > input_micros:
        raise invalid_request("cached_input must not exceed input", param="cached_input")
    if isinstance(data.batch_percent, bool) or not isinstance(data.batch_percent, int) or not (
        0 <= data.batch_percent <= 100
    ):
        raise invalid_request(f"batch_percent must be an integer from 0 to 100; got {data.batch_percent!r}",
                              param="batch_percent")
    values: dict[str, object] = {
        "model": clean_name(data.model, param="model"),
        "input_per_mtok_micros": input_micros,
        "cached_input_per_mtok_micros": cached_micros,
        "output_per_mtok_micros": to_micros(data.output, "output"),
        "batch_percent": data.batch_percent,
    }
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
