"""The quota interface shared by the in-process and the Redis store.

Semantics (both stores, same tests):
- Windows are fixed: requests and tokens per UTC minute, the token budget per UTC calendar month.
- `reserve` checks every limit and, only if all pass, takes one request, `slots` concurrency slots,
  `tokens` tokens and the reservation's spend in one atomic step. A rejection changes nothing.
- Two scopes: the tenant's counters, and, for a key with limits of its own (`KeyQuota`), the key's counters
  (requests, tokens, monthly tokens and spend; concurrency is the tenant's only). Both are checked and taken
  in the same atomic step, tenant first, and `Decision.scope` names the scope that refused.
- Spend is integer micro-dollars per UTC calendar month. A reservation holds `SpendRate.cost(tokens)`: its
  prompt at the input price and the rest at the output price — at least what it can be billed, as cached
  tokens cost no more than input ones. `reconcile` replaces it by the request's bill (`actual_cost`, the
  `requests.cost_micros` its final write computed), so once every reservation of a month is settled the
  counter is the sum of the month's bills. Without `actual_cost` it is replaced by
  `SpendRate.cost(actual_tokens)` (prompt tokens first), an upper bound of the bill.
- A tenant's concurrency is the sum of the slots of its live leases; `max_concurrent_requests` bounds that
  sum, so a request holding k slots (e.g. k sequences) counts k times.
- `reconcile` releases all the reservation's slots and replaces the reserved tokens by the real count,
  exactly once per reservation: a second call for the same reservation is a no-op that returns False.
- Monthly counters start from the database (`MonthLedger`, `quotas/ledger.py`): before a store admits anything
  for a scope whose counters of the current month it does not hold, it reads what the scope was billed this
  month and starts there, so a restart, a flush or a lost Redis never hands out a fresh month. Concurrent
  reservations seed at most once (set-if-absent, then the atomic reserve). A store built without a ledger
  (a worker, which only reconciles) starts them at zero. What is not seen: the tokens of a request that was
  in flight when Redis lost its counters, settled after the seed was read (its reconcile finds no lease).
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

from pagewise.serving.protocol import Reservation, SpendRate

Rejection = Literal["concurrency", "requests", "tokens", "monthly_budget", "monthly_spend"]
Scope = Literal["tenant", "key"]
DEFAULT_LEASE_S = 60.0  # the heartbeat renews live leases every third of this


class QuotaLimits(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's (or a key's) limits; `None` means unlimited. Spend is in micro-dollars."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    monthly_token_budget: int | None = None
    max_concurrent_requests: int | None = None
    monthly_spend_budget_micros: int | None = None


class KeyQuota(msgspec.Struct, frozen=True):
    """An API key's own limits, counted under `key_id` on top of its tenant's (never concurrency)."""

    key_id: str
    limits: QuotaLimits


class MonthToDate(msgspec.Struct, frozen=True, kw_only=True):
    """What a scope was billed in one month, from the database: tokens (prompt + completion) and spend."""

    tokens: int
    spend: int


class MonthLedger(Protocol):
    async def month_to_date(self, scope: Scope, scope_id: str, month: str) -> MonthToDate:
        """What the tenant (or the key lineage) `scope_id` was billed in `month` (`YYYYMM`, UTC)."""
        ...


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
    spend_this_month: int = 0


class ScopeState(msgspec.Struct, frozen=True):
    """One scope's limits and counters in a decision."""

    limits: QuotaLimits
    usage: QuotaUsage


class Decision(msgspec.Struct, frozen=True):
    """The outcome of `reserve`: a reservation, or what rejected it. `usage` and `limits` are the tenant's,
    `key` the key's (when it has limits), all after the decision; `scope` names the scope that refused."""

    reservation: Reservation | None
    rejected_by: Rejection | None
    usage: QuotaUsage
    limits: QuotaLimits
    scope: Scope = "tenant"
    key: ScopeState | None = None

    @property
    def refusing(self) -> ScopeState:
        """The limits and counters of the scope that refused (the tenant's when none did)."""
        return self.key if self.scope == "key" and self.key is not None else ScopeState(self.limits, self.usage)


class QuotaStore(Protocol):
    lease_s: float
    """How long a reservation holds its slot without `renew`."""

    async def reserve(
        self,
        tenant_id: str,
        limits: QuotaLimits,
        tokens: int,
        reservation_id: str,
        *,
        slots: int = 1,
        key: KeyQuota | None = None,
        rate: SpendRate | None = None,
        interactive: bool = True,
    ) -> Decision:
        """Take one request, `slots` slots, `tokens` tokens and their spend at `rate` for the tenant (and `key`)
        if every limit allows it; else change nothing. A request that is not `interactive` (a batch line) is
        counted in the month's tokens and spend only: it holds no concurrency slot and takes nothing of the
        minute's requests and tokens (its reservation's `slots` is 0 and its `minute` -1).

        Raises `ValueError` for `tokens < 0` or `slots < 1` (a caller's bug, not a user's error).
        """
        ...

    async def renew(self, reservation: Reservation) -> bool:
        """Extend a live lease by a full lease from now; False if it was reconciled or has expired."""
        ...

    async def reconcile(self, reservation: Reservation, actual_tokens: int, actual_cost: int | None = None) -> bool:
        """Release the reservation's slots and replace its tokens by `actual_tokens` and its spend by
        `actual_cost` micro-dollars (the request's bill; see `Reservation.spend_delta` without it), in the windows
        it was counted in that are still current. Once per reservation: True the first time, False after (or once
        its lease expired)."""
        ...

    async def usage(self, scope_id: str) -> QuotaUsage:
        """The counters of a tenant (or, by its id, a key: no leases, so no concurrency)."""
        ...

    async def ping(self) -> bool:
        """Whether the store answers now (quickly: `/ready` asks it)."""
        ...

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
    spend: int = 0,
    month_spend: int = 0,
) -> Rejection | None:
    """Which limit admitting one request of `tokens` tokens, `slots` slots and `spend` micro-dollars would
    break; `None` if none.

    Checked in a fixed order (the Redis script keeps the same one): concurrency, requests, tokens, budget,
    spend.
    """
    if limits.max_concurrent_requests is not None and concurrent + slots > limits.max_concurrent_requests:
        return "concurrency"
    if limits.requests_per_minute is not None and requests + 1 > limits.requests_per_minute:
        return "requests"
    if limits.tokens_per_minute is not None and minute_tokens + tokens > limits.tokens_per_minute:
        return "tokens"
    if limits.monthly_token_budget is not None and month_tokens + tokens > limits.monthly_token_budget:
        return "monthly_budget"
    budget = limits.monthly_spend_budget_micros
    if budget is not None and month_spend + spend > budget:
        return "monthly_spend"
    return None
