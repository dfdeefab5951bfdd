"""The in-process quota store (embedded mode).

Invariants:
- Every method runs without awaiting in between reads and writes, so on one event loop each call is atomic —
  the same guarantee the Redis store gets from Lua.
- A tenant's concurrency is the sum of the slots of its live leases (`leases`: reservation id → lease);
  there is no separate counter that could drift from it. An expired lease is dropped, all its slots at
  once, before anything is read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagewise.platform.quotas.quota_store import (
    DEFAULT_LEASE_S,
    Decision,
    QuotaLimits,
    QuotaUsage,
    QuotaWindows,
    Reservation,
    check_request_size,
    first_rejection,
)


@dataclass(slots=True)
class _Lease:
    expiry: float
    slots: int


@dataclass(slots=True)
class _TenantCounters:
    minute: int = -1
    month: str = ""
    requests_this_minute: int = 0
    tokens_this_minute: int = 0
    tokens_this_month: int = 0
    leases: dict[str, _Lease] = field(default_factory=dict)

    def roll(self, windows: QuotaWindows) -> None:
        """Start fresh windows when the minute or the month has changed."""
        if windows.minute != self.minute:
            self.minute, self.requests_this_minute, self.tokens_this_minute = windows.minute, 0, 0
        if windows.month != self.month:
            self.month, self.tokens_this_month = windows.month, 0

    def expire(self, now: float) -> None:
        """Release the slots of leases that ran out (their holder crashed or never reconciled)."""
        for reservation_id in [r for r, lease in self.leases.items() if lease.expiry <= now]:
            del self.leases[reservation_id]

    @property
    def slots_held(self) -> int:
        return sum(lease.slots for lease in self.leases.values())


class InProcessQuotaStore:
    def __init__(self, clock: Callable[[], float] = time.time, lease_s: float = DEFAULT_LEASE_S) -> None:
        self._clock = clock
        self.lease_s = lease_s
        self._tenants: dict[str, _TenantCounters] = {}

    def _counters(self, tenant_id: str) -> tuple[_TenantCounters, QuotaWindows, float]:
        now = self._clock()
        windows = QuotaWindows.at(now)
        counters = self._tenants.setdefault(tenant_id, _TenantCounters())
        counters.roll(windows)
        counters.expire(now)
        return counters, windows, now

    async def reserve(
        self, tenant_id: str, limits: QuotaLimits, tokens: int, reservation_id: str, *, slots: int = 1
    ) -> Decision:
        check_request_size(tokens, slots)
        c, windows, now = self._counters(tenant_id)
        rejected = first_rejection(
            limits,
            tokens,
            slots,
            c.slots_held,
            c.requests_this_minute,
            c.tokens_this_minute,
            c.tokens_this_month,
        )
        reservation = None
        if rejected is None:
            c.requests_this_minute += 1
            c.tokens_this_minute += tokens
            c.tokens_this_month += tokens
            c.leases[reservation_id] = _Lease(now + self.lease_s, slots)
            reservation = Reservation(reservation_id, tenant_id, tokens, windows.minute, windows.month, slots)
        return Decision(reservation, rejected, self._snapshot(c, windows), limits)

    async def renew(self, reservation: Reservation) -> bool:
        c, _, now = self._counters(reservation.tenant_id)
        lease = c.leases.get(reservation.id)
        if lease is None:
            return False
        lease.expiry = now + self.lease_s
        return True

    async def reconcile(self, reservation: Reservation, actual_tokens: int) -> bool:
        c, _, _ = self._counters(reservation.tenant_id)
        if c.leases.pop(reservation.id, None) is None:
            return False
        delta = actual_tokens - reservation.tokens
        if reservation.minute == c.minute:
            c.tokens_this_minute += delta
        if reservation.month == c.month:
            c.tokens_this_month += delta
        return True

    async def usage(self, tenant_id: str) -> QuotaUsage:
        c, windows, _ = self._counters(tenant_id)
        return self._snapshot(c, windows)

    async def close(self) -> None:
        self._tenants.clear()

    @staticmethod
    def _snapshot(c: _TenantCounters, windows: QuotaWindows) -> QuotaUsage:
        return QuotaUsage(
            concurrent=c.slots_held,
            outstanding=len(c.leases),
            requests_this_minute=c.requests_this_minute,
            tokens_this_minute=c.tokens_this_minute,
            tokens_this_month=c.tokens_this_month,
            minute_resets_in=windows.minute_resets_in,
            month_resets_in=windows.month_resets_in,
        )
