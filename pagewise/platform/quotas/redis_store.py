"""The Redis quota store (used when `PAGEWISE_REDIS_URL` is set). Each operation is one Lua script: atomic.

Keys per tenant under the configured prefix: `req:<minute>` and `tok:<minute>` (expire after two minutes),
`month:<YYYYMM>` (expires after the month), and two sorted sets scored by a lease's expiry (unix seconds):
`leases` holds one member per outstanding reservation (its id), `slots` one member per slot it holds
(`<id>:0` … `<id>:<k-1>`). Both are always written together with the same score, so a reservation and its
slots expire, renew and go together. A tenant's concurrency is `ZCARD slots`: every script first drops
expired members from both (`ZREMRANGEBYSCORE -inf now`), so the slots of a crashed process come back once
its lease runs out. Exactly-once reconciliation rests on `ZREM leases <id>` returning 1 only the first
time. Both sets expire one lease after their newest write, so an idle tenant leaves nothing behind.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import redis.asyncio as redis

from pagewise.platform.quotas.quota_store import (
    DEFAULT_LEASE_S,
    Decision,
    QuotaLimits,
    QuotaUsage,
    QuotaWindows,
    Rejection,
    Reservation,
    check_request_size,
)

_MINUTE_TTL_S = 120
_MONTH_EXTRA_TTL_S = 7 * 86400

# Shared by the scripts. A live lease's slots are always present with its score, so writing a lease anew
# (plain ZADD) is how `renew` extends it too.
_LEASE_FUNCTIONS = """
local function drop_expired(leases, slots, now)
  redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
  redis.call('ZREMRANGEBYSCORE', slots, '-inf', now)
end
local function write_lease(leases, slots, id, k, expiry, lease)
  redis.call('ZADD', leases, expiry, id)
  for i = 0, k - 1 do redis.call('ZADD', slots, expiry, id .. ':' .. i) end
  redis.call('EXPIRE', leases, math.ceil(lease) + 1)
  redis.call('EXPIRE', slots, math.ceil(lease) + 1)
end
"""

# KEYS: leases, slots, req, tok, month · ARGV: max_conc, rpm, tpm, budget (-1 = unlimited), tokens, id,
#       minute ttl, month ttl, now, lease seconds, slots
_RESERVE = _LEASE_FUNCTIONS + """
local now, lease, k = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
drop_expired(KEYS[1], KEYS[2], now)
local conc = redis.call('ZCARD', KEYS[2])
local outstanding = redis.call('ZCARD', KEYS[1])
local reqs = tonumber(redis.call('GET', KEYS[3]) or '0')
local toks = tonumber(redis.call('GET', KEYS[4]) or '0')
local month = tonumber(redis.call('GET', KEYS[5]) or '0')
local tokens = tonumber(ARGV[5])
local rejected = ''
if tonumber(ARGV[1]) >= 0 and conc + k > tonumber(ARGV[1]) then rejected = 'concurrency'
elseif tonumber(ARGV[2]) >= 0 and reqs + 1 > tonumber(ARGV[2]) then rejected = 'requests'
elseif tonumber(ARGV[3]) >= 0 and toks + tokens > tonumber(ARGV[3]) then rejected = 'tokens'
elseif tonumber(ARGV[4]) >= 0 and month + tokens > tonumber(ARGV[4]) then rejected = 'monthly_budget'
end
if rejected == '' then
  write_lease(KEYS[1], KEYS[2], ARGV[6], k, now + lease, lease)
  conc, outstanding = conc + k, outstanding + 1
  reqs = redis.call('INCR', KEYS[3])
  redis.call('EXPIRE', KEYS[3], ARGV[7])
  toks = redis.call('INCRBY', KEYS[4], tokens)
  redis.call('EXPIRE', KEYS[4], ARGV[7])
  month = redis.call('INCRBY', KEYS[5], tokens)
  redis.call('EXPIRE', KEYS[5], ARGV[8])
end
return {rejected, conc, outstanding, reqs, toks, month}
"""

# KEYS: leases, slots · ARGV: id, now, lease seconds, slots
_RENEW = _LEASE_FUNCTIONS + """
local now, lease = tonumber(ARGV[2]), tonumber(ARGV[3])
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not expiry or tonumber(expiry) <= now then return 0 end
write_lease(KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[4]), now + lease, lease)
return 1
"""

# KEYS: leases, slots, tok (reservation's minute), month (reservation's month)
# ARGV: id, reserved, actual, now, slots
_RECONCILE = _LEASE_FUNCTIONS + """
drop_expired(KEYS[1], KEYS[2], ARGV[4])
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
for i = 0, tonumber(ARGV[5]) - 1 do redis.call('ZREM', KEYS[2], ARGV[1] .. ':' .. i) end
local delta = tonumber(ARGV[3]) - tonumber(ARGV[2])
if delta ~= 0 then
  if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('INCRBY', KEYS[3], delta) end
  if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('INCRBY', KEYS[4], delta) end
end
return 1
"""


def _limit(value: int | None) -> int:
    return -1 if value is None else value


class RedisQuotaStore:
    """Quota counters in Redis. `client` must decode responses (`decode_responses=True`)."""

    def __init__(
        self,
        client: redis.Redis,
        key_prefix: str,
        clock: Callable[[], float] = time.time,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> None:
        self._redis = client
        self._prefix = key_prefix
        self._clock = clock
        self.lease_s = lease_s
        self._reserve = client.register_script(_RESERVE)
        self._renew = client.register_script(_RENEW)
        self._reconcile = client.register_script(_RECONCILE)

    @classmethod
    def from_url(
        cls,
        url: str,
        key_prefix: str,
        clock: Callable[[], float] = time.time,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> RedisQuotaStore:
        return cls(redis.Redis.from_url(url, decode_responses=True), key_prefix, clock, lease_s)

    def _key(self, tenant_id: str, name: str) -> str:
        return f"{self._prefix}quota:{tenant_id}:{name}"

    async def reserve(
        self, tenant_id: str, limits: QuotaLimits, tokens: int, reservation_id: str, *, slots: int = 1
    ) -> Decision:
        check_request_size(tokens, slots)
        now = self._clock()
        w = QuotaWindows.at(now)
        keys = [
            self._key(tenant_id, k)
            for k in ("leases", "slots", f"req:{w.minute}", f"tok:{w.minute}", f"month:{w.month}")
        ]
        args = [
            _limit(limits.max_concurrent_requests),
            _limit(limits.requests_per_minute),
            _limit(limits.tokens_per_minute),
            _limit(limits.monthly_token_budget),
            tokens,
            reservation_id,
            _MINUTE_TTL_S,
            math.ceil(w.month_resets_in) + _MONTH_EXTRA_TTL_S,
            repr(now),
            self.lease_s,
            slots,
        ]
        rejected, conc, outstanding, reqs, toks, month = await self._reserve(keys=keys, args=args)
        rejected_by: Rejection | None = rejected or None
        reservation = None
        if rejected_by is None:
            reservation = Reservation(reservation_id, tenant_id, tokens, w.minute, w.month, slots)
        usage = QuotaUsage(
            concurrent=int(conc),
            outstanding=int(outstanding),
            requests_this_minute=int(reqs),
            tokens_this_minute=int(toks),
            tokens_this_month=int(month),
            minute_resets_in=w.minute_resets_in,
            month_resets_in=w.month_resets_in,
        )
        return Decision(reservation, rejected_by, usage, limits)

    async def renew(self, reservation: Reservation) -> bool:
        keys = [self._key(reservation.tenant_id, "leases"), self._key(reservation.tenant_id, "slots")]
        args = [reservation.id, repr(self._clock()), self.lease_s, reservation.slots]
        return bool(await self._renew(keys=keys, args=args))

    async def reconcile(self, reservation: Reservation, actual_tokens: int) -> bool:
        t = reservation.tenant_id
        keys = [
            self._key(t, "leases"),
            self._key(t, "slots"),
            self._key(t, f"tok:{reservation.minute}"),
            self._key(t, f"month:{reservation.month}"),
        ]
        args = [reservation.id, reservation.tokens, actual_tokens, repr(self._clock()), reservation.slots]
        return bool(await self._reconcile(keys=keys, args=args))

    async def usage(self, tenant_id: str) -> QuotaUsage:
        """A read-only snapshot: leases past their expiry are not counted (the next write drops them)."""
        now = self._clock()
        w = QuotaWindows.at(now)
        names = (f"req:{w.minute}", f"tok:{w.minute}", f"month:{w.month}")
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.mget([self._key(tenant_id, n) for n in names])
            pipe.zcount(self._key(tenant_id, "slots"), f"({now!r}", "+inf")
            pipe.zcount(self._key(tenant_id, "leases"), f"({now!r}", "+inf")
            values, live_slots, live_leases = await pipe.execute()
        reqs, toks, month = (int(v or 0) for v in values)
        return QuotaUsage(
            concurrent=int(live_slots),
            outstanding=int(live_leases),
            requests_this_minute=reqs,
            tokens_this_minute=toks,
            tokens_this_month=month,
            minute_resets_in=w.minute_resets_in,
            month_resets_in=w.month_resets_in,
        )

    async def close(self) -> None:
        await self._redis.aclose()
