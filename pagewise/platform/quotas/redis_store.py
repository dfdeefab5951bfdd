"""The Redis quota store (used when `PAGEWISE_REDIS_URL` is set). Each operation is one Lua script: atomic.

Keys per tenant under the configured prefix: `conc` (in-flight requests), `req:<minute>` and `tok:<minute>`
(expire after two minutes), `month:<YYYYMM>` (expires after the month), and the hash `res` of outstanding
reservations. Exactly-once reconciliation rests on `HDEL res <id>` returning 1 only the first time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import redis.asyncio as redis

from pagewise.platform.quotas.quota_store import (
    Decision,
    QuotaLimits,
    QuotaUsage,
    QuotaWindows,
    Rejection,
    Reservation,
)

_MINUTE_TTL_S = 120
_MONTH_EXTRA_TTL_S = 7 * 86400

# KEYS: conc, req, tok, month, res · ARGV: max_conc, rpm, tpm, budget (-1 = unlimited), tokens, id, ttls
_RESERVE = """
local conc = tonumber(redis.call('GET', KEYS[1]) or '0')
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
  conc = redis.call('INCR', KEYS[1])
  reqs = redis.call('INCR', KEYS[2])
  redis.call('EXPIRE', KEYS[2], ARGV[7])
  toks = redis.call('INCRBY', KEYS[3], tokens)
  redis.call('EXPIRE', KEYS[3], ARGV[7])
  month = redis.call('INCRBY', KEYS[4], tokens)
  redis.call('EXPIRE', KEYS[4], ARGV[8])
  redis.call('HSET', KEYS[5], ARGV[6], tokens)
end
return {rejected, conc, reqs, toks, month, redis.call('HLEN', KEYS[5])}
"""

# KEYS: conc, res, tok (reservation's minute), month (reservation's month) · ARGV: id, reserved, actual
_RECONCILE = """
if redis.call('HDEL', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('DECR', KEYS[1])
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

    def __init__(self, client: redis.Redis, key_prefix: str, clock: Callable[[], float] = time.time) -> None:
        self._redis = client
        self._prefix = key_prefix
        self._clock = clock
        self._reserve = client.register_script(_RESERVE)
        self._reconcile = client.register_script(_RECONCILE)

    @classmethod
    def from_url(cls, url: str, key_prefix: str, clock: Callable[[], float] = time.time) -> RedisQuotaStore:
        return cls(redis.Redis.from_url(url, decode_responses=True), key_prefix, clock)

    def _key(self, tenant_id: str, name: str) -> str:
        return f"{self._prefix}quota:{tenant_id}:{name}"

    async def reserve(
        self, tenant_id: str, limits: QuotaLimits, tokens: int, reservation_id: str
    ) -> Decision:
        w = QuotaWindows.at(self._clock())
        keys = [
            self._key(tenant_id, k)
            for k in ("conc", f"req:{w.minute}", f"tok:{w.minute}", f"month:{w.month}")
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
        ]
        rejected, conc, reqs, toks, month, outstanding = await self._reserve(
            keys=[*keys, self._key(tenant_id, "res")], args=args
        )
        rejected_by: Rejection | None = rejected or None
        reservation = None
        if rejected_by is None:
            reservation = Reservation(reservation_id, tenant_id, tokens, w.minute, w.month)
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

    async def reconcile(self, reservation: Reservation, actual_tokens: int) -> bool:
        t = reservation.tenant_id
        keys = [
            self._key(t, "conc"),
            self._key(t, "res"),
            self._key(t, f"tok:{reservation.minute}"),
            self._key(t, f"month:{reservation.month}"),
        ]
        return bool(
            await self._reconcile(keys=keys, args=[reservation.id, reservation.tokens, actual_tokens])
        )

    async def usage(self, tenant_id: str) -> QuotaUsage:
        w = QuotaWindows.at(self._clock())
        names = ("conc", f"req:{w.minute}", f"tok:{w.minute}", f"month:{w.month}")
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.mget([self._key(tenant_id, n) for n in names])
            pipe.hlen(self._key(tenant_id, "res"))
            values, outstanding = await pipe.execute()
        conc, reqs, toks, month = (int(v or 0) for v in values)
        return QuotaUsage(
            concurrent=conc,
            outstanding=int(outstanding),
            requests_this_minute=reqs,
            tokens_this_minute=toks,
            tokens_this_month=month,
            minute_resets_in=w.minute_resets_in,
            month_resets_in=w.month_resets_in,
        )

    async def close(self) -> None:
        await self._redis.aclose()
