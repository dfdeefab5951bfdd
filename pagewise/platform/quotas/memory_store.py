"""The in-process quota store (embedded mode).

Invariants:
- Every method runs without awaiting in between reads and writes, so on one event loop each call is atomic —
  the same guarantee the Redis store gets from Lua.
- A scope's monthly counters are seeded from the ledger (when the store has one) before its first reservation
  of the month: `seeded` names the month they were seeded for. The ledger is read before the counters are
  touched (the only await), so a reservation racing the seed sees either no seed (and seeds, once) or the seed.
- A tenant's concurrency is the sum of the slots of its live leases (`leases`: reservation id → lease);
  there is no separate counter that could drift from it. An expired lease is dropped, all its slots at
  once, before anything is read. A key's counters (same shape, keyed by its id) never hold leases.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagewise.platform.quotas.quota_store import (
    DEFAULT_LEASE_S,
    Decision,
    KeyQuota,
    MonthLedger,
    QuotaLimits,
    QuotaUsage,
    QuotaWindows,
    Rejection,
    Reservation,
    Scope,
    ScopeState,
    SpendRate,
    check_request_size,
    first_rejection,
)


@dataclass(slots=True)
class _Lease:
    expiry: float
    slots: int


@dataclass(slots=True)
class _Counters:
    minute: int = -1
    month: str = ""
    requests_this_minute: int = 0
    tokens_this_minute: int = 0
    tokens_this_month: int = 0
    spend_this_month: int = 0
    seeded: str = ""
    leases: dict[str, _Lease] = field(default_factory=dict)

    def roll(self, windows: QuotaWindows) -> None:
        """Start fresh windows when the minute or the month has changed."""
        if windows.minute != self.minute:
            self.minute, self.requests_this_minute, self.tokens_this_minute = windows.minute, 0, 0
        if windows.month != self.month:
            self.month, self.tokens_this_month, self.spend_this_month = windows.month, 0, 0

    def expire(self, now: float) -> None:
        """Release the slots of leases that ran out (their holder crashed or never reconciled)."""
        for reservation_id in [r for r, lease in self.leases.items() if lease.expiry <= now]:
            del self.leases[reservation_id]

    @property
    def slots_held(self) -> int:
        return sum(lease.slots for lease in self.leases.values())

    def rejection(self, limits: QuotaLimits, tokens: int, slots: int, spend: int) -> Rejection | None:
        return first_rejection(
            limits,
            tokens,
            slots,
            self.slots_held,
            self.requests_this_minute,
            self.tokens_this_minute,
            self.tokens_this_month,
            spend,
            self.spend_this_month,
        )

    def take(self, tokens: int, spend: int, interactive: bool) -> None:
        if interactive:
            self.requests_this_minute += 1
            self.tokens_this_minute += tokens
        self.tokens_this_month += tokens
        self.spend_this_month += spend

    def give_back(self, reservation: Reservation, tokens_delta: int, spend_delta: int) -> None:
        """Correct the windows the reservation was counted in, if they are still the current ones."""
        if reservation.minute == self.minute:
            self.tokens_this_minute += tokens_delta
        if reservation.month == self.month:
            self.tokens_this_month += tokens_delta
            self.spend_this_month += spend_delta


class InProcessQuotaStore:
    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        lease_s: float = DEFAULT_LEASE_S,
        ledger: MonthLedger | None = None,
    ) -> None:
        self._clock = clock
        self.lease_s = lease_s
        self._ledger = ledger
        self._scopes: dict[str, _Counters] = {}

    def _counters(self, scope_id: str) -> tuple[_Counters, QuotaWindows, float]:
        now = self._clock()
        windows = QuotaWindows.at(now)
        counters = self._scopes.setdefault(scope_id, _Counters())
        counters.roll(windows)
        counters.expire(now)
        return counters, windows, now

    async def _seed(self, scope: Scope, scope_id: str) -> None:
        """Start the scope's counters of the current month at what the ledger says it was billed in it."""
        if self._ledger is None:
            return
        while True:
            month = QuotaWindows.at(self._clock()).month
            counters = self._scopes.get(scope_id)
            if counters is not None and counters.seeded == month:
                return
            totals = await self._ledger.month_to_date(scope, scope_id, month)
            counters, windows, _ = self._counters(scope_id)
            if windows.month == month and counters.seeded != month:
                counters.tokens_this_month, counters.spend_this_month = totals.tokens, totals.spend
                counters.seeded = month

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
        check_request_size(tokens, slots)
        held = slots if interactive else 0
        await self._seed("tenant", tenant_id)
        if key is not None:
            await self._seed("key", key.key_id)
        spend = 0 if rate is None else rate.cost(tokens)
        c, windows, now = self._counters(tenant_id)
        k = None if key is None else self._counters(key.key_id)[0]
        rejected, scope = c.rejection(limits, tokens, held, spend), "tenant"
        if rejected is None and k is not None and key is not None:
            rejected = k.rejection(key.limits, tokens, 0, spend)
            scope = "tenant" if rejected is None else "key"
        reservation = None
        if rejected is None:
            c.take(tokens, spend, interactive)
            c.leases[reservation_id] = _Lease(now + self.lease_s, held)
            if k is not None:
                k.take(tokens, spend, interactive)
            key_id = None if key is None else key.key_id
            minute = windows.minute if interactive else -1
            reservation = Reservation(
                reservation_id, tenant_id, tokens, minute, windows.month, held, key_id, spend, rate
            )
        key_state = None if k is None or key is None else ScopeState(key.limits, self._snapshot(k, windows))
        return Decision(reservation, rejected, self._snapshot(c, windows), limits, scope, key_state)

    async def renew(self, reservation: Reservation) -> bool:
        c, _, now = self._counters(reservation.tenant_id)
        lease = c.leases.get(reservation.id)
        if lease is None:
            return False
        lease.expiry = now + self.lease_s
        return True

    async def reconcile(self, reservation: Reservation, actual_tokens: int, actual_cost: int | None = None) -> bool:
        c, _, _ = self._counters(reservation.tenant_id)
        if c.leases.pop(reservation.id, None) is None:
            return False
        tokens_delta = actual_tokens - reservation.tokens
        spend_delta = reservation.spend_delta(actual_tokens, actual_cost)
        c.give_back(reservation, tokens_delta, spend_delta)
        if reservation.key_id is not None:
            self._counters(reservation.key_id)[0].give_back(reservation, tokens_delta, spend_delta)
        return True

    async def usage(self, scope_id: str) -> QuotaUsage:
        c, windows, _ = self._counters(scope_id)
        return self._snapshot(c, windows)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._scopes.clear()

    @staticmethod
    def _snapshot(c: _Counters, windows: QuotaWindows) -> QuotaUsage:
        return QuotaUsage(
            concurrent=c.slots_held,
            outstanding=len(c.leases),
            requests_this_minute=c.requests_this_minute,
            tokens_this_minute=c.tokens_this_minute,
            tokens_this_month=c.tokens_this_month,
            minute_resets_in=windows.minute_resets_in,
            month_resets_in=windows.month_resets_in,
            spend_this_month=c.spend_this_month,
        )
