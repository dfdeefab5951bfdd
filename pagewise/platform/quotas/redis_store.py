"""The Redis quota store (used when `PAGEWISE_REDIS_URL` is set). Each operation is one Lua script: atomic.

Keys per tenant under the configured prefix: `req:<minute>` and `tok:<minute>` (expire after two minutes),
`month:<YYYYMM>` (expires after the month), and the sorted set `leases` of outstanding reservation ids scored
by their lease's expiry (unix seconds). A tenant's concurrency is the number of live leases: every script
first drops the expired ones (`ZREMRANGEBYSCORE -inf now`), so a slot held by a crashed process comes back
once its lease runs out. Exactly-once reconciliation rests on `ZREM leases <id>` returning 1 only the first
time. The key `leases` expires one lease after its newest write, so an idle tenant leaves nothing behind.
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
)

_MINUTE_TTL_S = 120
_MONTH_EXTRA_TTL_S = 7 * 86400

# KEYS: leases, req, tok, month · ARGV: max_conc, rpm, tpm, budget (-1 = unlimited), tokens, id,
#       minute ttl, month ttl, now, lease seconds
_RESERVE = """
local now, lease = tonumber(ARGV[9]), tonumber(ARGV[10])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local conc = redis.call('ZCARD', KEYS[1])
local reqs = tonumber(redis.call('GET', KEYS[2]) or '0')
local toks = tonumber(redis.call('GET', KEYS[3]) or '0')
local month = tonumber(redis.call('GET', KEYS[4]) or '0')
local tokens = tonumber(ARGV[5])
local rejected = ''
if tonumber(ARGV[1]) >= 0 and conc + 1 > tonumber(ARGV[1]) then rejected = 'concurrency'
elseif tonumber(ARGV[2]) >= 0 and reqs + 1 > tonumber(ARGV[2]) then rejected = 'requests'
elseif tonumber(ARGV[3]) >= 0 and toks + tokens > tonumber(ARGV[3]) then rejected = 'tokens'
elseif tonumber(ARGV[4]) >= 0 and month + tokens > tonumber(ARGV[4]) then rejected = 'monthly_budget'
end
if rejected == '' then
  redis.call('ZADD', KEYS[1], now + lease, ARGV[6])
  redis.call('EXPIRE', KEYS[1], math.ceil(lease) + 1)
  conc = conc + 1
  reqs = redis.call('INCR', KEYS[2])
  redis.call('EXPIRE', KEYS[2], ARGV[7])
  toks = redis.call('INCRBY', KEYS[3], tokens)
  redis.call('EXPIRE', KEYS[3], ARGV[7])
  month = redis.call('INCRBY', KEYS[4], tokens)
  redis.call('EXPIRE', KEYS[4], ARGV[8])
end
return {rejected, conc, reqs, toks, month}
"""

# KEYS: leases · ARGV: id, now, lease seconds
_RENEW = """
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not expiry or tonumber(expiry) <= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], 'XX', tonumber(ARGV[2]) + tonumber(ARGV[3]), ARGV[1])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3])) + 1)
return 1
"""

# KEYS: leases, tok (reservation's minute), month (reservation's month) · ARGV: id, reserved, actual, now
_RECONCILE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[4])
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
local delta = tonumber(ARGV[3]) - tonumber(ARGV[2])
if delta ~= 0 then
  if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('INCRBY', KEYS[2], delta) end
  if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('INCRBY', KEYS[3], delta) end
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
        self, tenant_id: str, limits: QuotaLimits, tokens: int, reservation_id: str
    ) -> Decision:
        now = self._clock()
        w = QuotaWindows.at(now)
        keys = [
            self._key(tenant_id, k)
            for k in ("leases", f"req:{w.minute}", f"tok:{w.minute}", f"month:{w.month}")
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
        ]
        rejected, conc, reqs, toks, month = await self._reserve(keys=keys, args=args)
        rejected_by: Rejection | None = rejected or None
        reservation = None
        if rejected_by is None:
            reservation = Reservation(reservation_id, tenant_id, tokens, w.minute, w.month)
        usage = QuotaUsage(
            concurrent=int(conc),
            outstanding=int(conc),
            requests_this_minute=int(reqs),
            tokens_this_minute=int(toks),
            tokens_this_month=int(month),
            minute_resets_in=w.minute_resets_in,
            month_resets_in=w.month_resets_in,
        )
        return Decision(reservation, rejected_by, usage, limits)

    async def renew(self, reservation: Reservation) -> bool:
        keys = [self._key(reservation.tenant_id, "leases")]
        return bool(await self._renew(keys=keys, args=[reservation.id, repr(self._clock()), self.lease_s]))

    async def reconcile(self, reservation: Reservation, actual_tokens: int) -> bool:
        t = reservation.tenant_id
        keys = [
            self._key(t, "leases"),
            self._key(t, f"tok:{reservation.minute}"),
            self._key(t, f"month:{reservation.month}"),
        ]
        args = [reservation.id, reservation.tokens, actual_tokens, repr(self._clock())]
        return bool(await self._reconcile(keys=keys, args=args))

    async def usage(self, tenant_id: str) -> QuotaUsage:
        """A read-only snapshot: leases past their expiry are not counted (the next write drops them)."""
        now = self._clock()
        w = QuotaWindows.at(now)
        names = (f"req:{w.minute}", f"tok:{w.minute}", f"month:{w.month}")
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.mget([self._key(tenant_id, n) for n in names])
            pipe.zcount(self._key(tenant_id, "leases"), f"({now!r}", "+inf")
            values, live = await pipe.execute()
        reqs, toks, month = (int(v or 0) for v in values)
        return QuotaUsage(
            concurrent=int(live),
            outstanding=int(live),
            requests_this_minute=reqs,
            tokens_this_minute=toks,
            tokens_this_month=month,
            minute_resets_in=w.minute_resets_in,
            month_resets_in=w.month_resets_in,
        )

    async def close(self) -> None:
        await self._redis.aclose()
