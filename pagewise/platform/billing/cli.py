"""`pagewise prices list | set` — registered into the top-level CLI by `register`.

Prices on the command line are dollars per million tokens (`--input 0.15`), as in `POST /admin/prices`
(`{"input": 0.15}`); the price service converts both exactly to micro-dollars.
"""

from __future__ import annotations

import argparse
import datetime as dt
from typing import Any

from pagewise.platform.cli import add_command, in_session
from pagewise.platform.errors import invalid_request


def register(subparsers: argparse._SubParsersAction) -> None:
    prices = subparsers.add_parser("prices", help="model prices (billing)").add_subparsers(
        dest="prices_command", required=True
    )
    listing = add_command(prices, "list", in_session(_prices_list), "list price versions, by model, newest first")
    listing.add_argument("--model")
    set_price = add_command(prices, "set", in_session(_prices_set), "add a price version for a model")
    set_price.add_argument("model")
    set_price.add_argument("--input", required=True, help="dollars per million prompt tokens, e.g. 0.15")
    set_price.add_argument("--output", required=True, help="dollars per million completion tokens")
    set_price.add_argument("--cached-input", help="dollars per million cached prompt tokens (default: --input)")
    set_price.add_argument("--batch-percent", type=int, default=50, help="the share a batch line pays (default 50)")
    set_price.add_argument("--effective-from", help="ISO-8601 datetime, UTC unless it has an offset (default: now)")


def _moment(value: str) -> dt.datetime:
    try:
        return dt.datetime.fromisoformat(value.strip())
    except ValueError:
        raise invalid_request(
            f"--effective-from must be an ISO-8601 datetime such as 2030-01-31T00:00:00Z; got {value!r}",
            param="--effective-from",
        ) from None


def _print_price(price: Any) -> None:
    from pagewise.platform.db.models import as_utc
    from pagewise.serving.money import format_dollars

    effective_from = as_utc(price.effective_from)
    print(
        f"{price.id}  {price.model}  from {effective_from.isoformat(timespec='seconds')}"
        f"  input ${format_dollars(price.input_per_mtok_micros)}"
        f"  cached ${format_dollars(price.cached_input_per_mtok_micros)}"
        f"  output ${format_dollars(price.output_per_mtok_micros)}  per 1M tokens"
    )


async def _prices_list(session: Any, args: argparse.Namespace) -> None:
    from pagewise.platform.billing.prices import PriceService

    for price in await PriceService(session).list(args.model):
        _print_price(price)


async def _prices_set(session: Any, args: argparse.Namespace) -> None:
    from pagewise.platform.billing.prices import PriceService
    from pagewise.platform.billing.schemas import PriceCreate

    data = PriceCreate(  # the API's names and units: dollars per million tokens, checked by the service
        model=args.model,
        input=args.input,
        output=args.output,
        cached_input=args.cached_input,
        batch_percent=args.batch_percent,
        effective_from=None if args.effective_from is None else _moment(args.effective_from),
    )
    _print_price(await PriceService(session).create(data))
