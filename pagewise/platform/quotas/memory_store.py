"""The in-process quota store (embedded mode).

Invariant: every method runs without awaiting in between reads and writes, so on one event loop each call is
atomic — the same guarantee the Redis store gets from Lua.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagewise.platform.quotas.quota_store import (
    Decision,
    QuotaLimits,
    QuotaUsage,
    QuotaWindows,
    Reservation,
    first_rejection,
)


@dataclass(slots=True)
class _TenantCounters:
    minute: int = -1
    month: str = ""
    requests_this_minute: int = 0
    tokens_this_minute: int = 0
    tokens_this_month: int = 0
    concurrent: int = 0
    reservations: set[str] = field(default_factory=set)

    def roll(self, windows: QuotaWindows) -> None:
        """Start fresh windows when the minute or the month has changed."""
        if windows.minute != self.minute:
            self.minute, self.requests_this_minute, self.tokens_this_minute = windows.minute, 0, 0
        if windows.month != self.month:
            self.month, self.tokens_this_month = windows.month, 0


class InProcessQuotaStore:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._tenants: dict[str, _TenantCounters] = {}

    def _counters(self, tenant_id: str) -> tuple[_TenantCounters, QuotaWindows]:
        windows = QuotaWindows.at(self._clock())
        counters = self._tenants.setdefault(tenant_id, _TenantCounters())
        counters.roll(windows)
        return counters, windows

    async def reserve(
        self, tenant_id: str, limits: QuotaLimits, tokens: int, reservation_id: str
    ) -> Decision:
        c, windows = self._counters(tenant_id)
        rejected = first_rejection(
            limits, tokens, c.concurrent, c.requests_this_minute, c.tokens_this_minute, c.tokens_this_month
        )
        reservation = None
        if rejected is None:
            c.concurrent += 1
            c.requests_this_minute += 1
            c.tokens_this_minute += tokens
            c.tokens_this_month += tokens
            c.reservations.add(reservation_id)
            reservation = Reservation(reservation_id, tenant_id, tokens, windows.minute, windows.month)
        return Decision(reservation, rejected, self._snapshot(c, windows), limits)

    async def reconcile(self, reservation: Reservation, actual_tokens: int) -> bool:
        c, _ = self._counters(reservation.tenant_id)
        if reservation.id not in c.reservations:
            return False
        c.reservations.discard(reservation.id)
        c.concurrent -= 1
        delta = actual_tokens - reservation.tokens
        if reservation.minute == c.minute:
            c.tokens_this_minute += delta
        if reservation.month == c.month:
            c.tokens_this_month += delta
        return True

    async def usage(self, tenant_id: str) -> QuotaUsage:
        return self._snapshot(*self._counters(tenant_id))

    async def close(self) -> None:
        self._tenants.clear()

    @staticmethod
    def _snapshot(c: _TenantCounters, windows: QuotaWindows) -> QuotaUsage:
        return QuotaUsage(
            concurrent=c.concurrent,
            outstanding=len(c.reservations),
            requests_this_minute=c.requests_this_minute,
            tokens_this_minute=c.tokens_this_minute,
            tokens_this_month=c.tokens_this_month,
            minute_resets_in=windows.minute_resets_in,
            month_resets_in=windows.month_resets_in,
        )
