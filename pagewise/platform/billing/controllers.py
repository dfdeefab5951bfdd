"""`/admin/prices` (admin scope): list the price versions, add one."""

from __future__ import annotations

from litestar import Controller, get, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromQuery, SkipValidation

from pagewise.platform.billing.prices import PriceService, price_out
from pagewise.platform.billing.schemas import PriceCreate, PriceOut
from pagewise.platform.bodies import StrictBody, parse_body
from pagewise.platform.db.session import DbSession
from pagewise.platform.keys.auth import requires_scope

Prices = NamedDependency[SkipValidation[PriceService]]


def provide_price_service(db_session: DbSession) -> PriceService:
    return PriceService(db_session)


class PriceController(Controller):
    path = "/admin/prices"
    guards = [requires_scope("admin")]
    dependencies = {"prices": Provide(provide_price_service, sync_to_thread=False)}
    tags = ["admin", "billing"]

    @post("/")
    async def create_price(self, data: StrictBody[PriceCreate], prices: Prices) -> PriceOut:
        """A new price version; it applies to requests finishing at or after its `effective_from`."""
        return price_out(await prices.create(parse_body(data, PriceCreate)))

    @get("/")
    async def list_prices(self, prices: Prices, model: FromQuery[str | None] = None) -> list[PriceOut]:
        """Every version, by model, newest first."""
        return [price_out(p) for p in await prices.list(model)]
