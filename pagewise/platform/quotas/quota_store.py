"""The quota interface shared by the in-process and the Redis store.

Semantics (both stores, same tests):
- Windows are fixed: requests and tokens per UTC minute, the token budget per UTC calendar month.
- `reserve` checks every limit and, only if all pass, takes one request, `slots` concurrency slots and
  `tokens` tokens in one atomic step. A rejection changes nothing.
- A tenant's concurrency is the sum of the slots of its live leases; `max_concurrent_requests` bounds that
  sum, so a request holding k slots (e.g. k sequences) counts k times.
- `reconcile` releases all the reservation's slots and replaces the reserved tokens by the real count,
  exactly once per reservation: a second call for the same reservation is a no-op that returns False.
- A reservation is a lease: it holds its slots for `lease_s` seconds (renewable with `renew`, which extends
  all of them). A lease that runs out — its process crashed, or lost the reconcile — gives all its slots
  back at the next call for that tenant; its reserved tokens stay counted (the safe side), and a late
  `reconcile` is a no-op returning False. The platform's lease heartbeat renews every live
  reservation each third of a lease (`inference/leases.py`).
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Literal, Protocol

import msgspec

Rejection = Literal["concurrency", "requests", "tokens", "monthly_budget"]
DEFAULT_LEASE_S = 60.0  # the heartbeat renews live leases every third of this


class QuotaLimits(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's limits; `None` means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    monthly_token_budget: int | None = None
    max_concurrent_requests: int | None = None


class Reservation(msgspec.Struct, frozen=True):
    """What one admitted request holds: `tokens`, and `slots` concurrency slots (at least 1).

    `minute` and `month` name the windows its tokens were counted in.
    """

    id: str
    tenant_id: str
    tokens: int
    minute: int
    month: str
    slots: int = 1


class QuotaUsage(msgspec.Struct, frozen=True, kw_only=True):
    """Counters of one tenant at one moment, with the seconds until the minute and the month roll over.

    `concurrent` is the number of slots the live leases hold; `outstanding` is the number of live leases
    (reservations not yet reconciled). They are equal while every reservation holds one slot.
    """

    concurrent: int
    outstanding: int
    requests_this_minute: int
    tokens_this_minute: int
    tokens_this_month: int
    minute_resets_in: float
    month_resets_in: float


class Decision(msgspec.Struct, frozen=True):
    """The outcome of `reserve`: a reservation, or what rejected it. `usage` is after the decision."""

    reservation: Reservation | None
    rejected_by: Rejection | None
    usage: QuotaUsage
    limits: QuotaLimits


class QuotaStore(Protocol):
    lease_s: float
    """How long a reservation holds its slot without `renew`."""

    async def reserve(
        self, tenant_id: str, limits: QuotaLimits, tokens: int, reservation_id: str, *, slots: int = 1
    ) -> Decision:
        """Take one request, `slots` slots and `tokens` tokens if every limit allows it; else change nothing.

        Raises `ValueError` for `tokens < 0` or `slots < 1` (a caller's bug, not a user's error).
        """
        ...

    async def renew(self, reservation: Reservation) -> bool:
        """Extend a live lease by a full lease from now; False if it was reconciled or has expired."""
        ...

    async def reconcile(self, reservation: Reservation, actual_tokens: int) -> bool: ...

    async def usage(self, tenant_id: str) -> QuotaUsage: ...

    async def close(self) -> None: ...


class QuotaWindows(msgspec.Struct, frozen=True):
    """The minute and month windows that contain one instant."""

    minute: int
    month: str
    minute_resets_in: float
    month_resets_in: float

    @classmethod
    def at(cls, now: float) -> QuotaWindows:
        moment = dt.datetime.fromtimestamp(now, dt.UTC)
        next_month = (moment.replace(day=28) + dt.timedelta(days=4)).replace(
            day=1, hour=0, minute=0, second=0, microsecond=0
        )
        return cls(
            minute=math.floor(now / 60),
            month=moment.strftime("%Y%m"),
            minute_resets_in=60 - now % 60,
            month_resets_in=next_month.timestamp() - now,
        )


def check_request_size(tokens: int, slots: int) -> None:
    """What every store's `reserve` accepts: `tokens >= 0` and `slots >= 1`."""
    if tokens < 0:
        raise ValueError(f"tokens must be at least 0; got {tokens}")
    if slots < 1:
        raise ValueError(f"slots must be at least 1; got {slots}")


def first_rejection(
    limits: QuotaLimits,
    tokens: int,
    slots: int,
    concurrent: int,
    requests: int,
    minute_tokens: int,
    month_tokens: int,
) -> Rejection | None:
    """Which limit admitting one request of `tokens` tokens and `slots` slots would break; `None` if none.

    Checked in a fixed order (the Redis script keeps the same one): concurrency, requests, tokens, budget.
    """
    if limits.max_concurrent_requests is not None and concurrent + slots > limits.max_concurrent_requests:
        return "concurrency"
    if limits.requests_per_minute is not None and requests + 1 > limits.requests_per_minute:
        return "requests"
    if limits.tokens_per_minute is not None and minute_tokens + tokens > limits.tokens_per_minute:
        return "tokens"
    if limits.monthly_token_budget is not None and month_tokens + tokens > limits.monthly_token_budget:
        return "monthly_budget"
    return None
