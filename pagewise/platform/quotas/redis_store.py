"""The Redis quota store (used when `PAGEWISE_REDIS_URL` is set). Each operation is one Lua script: atomic.

Keys per tenant under the configured prefix: `req:<minute>` and `tok:<minute>` (expire after two minutes),
`month:<YYYYMM>` and `spend:<YYYYMM>` (expire after the month), and two sorted sets scored by a lease's
expiry (unix seconds): `leases` holds one member per outstanding reservation (its id), `slots` one member
per slot it holds (`<id>:0` … `<id>:<k-1>`). Both are always written together with the same score, so a
reservation and its slots expire, renew and go together. A tenant's concurrency is `ZCARD slots`: every
script first drops expired members from both (`ZREMRANGEBYSCORE -inf now`), so the slots of a crashed
process come back once its lease runs out. Exactly-once reconciliation rests on `ZREM leases <id>` returning
1 only the first time. Both sets expire one lease after their newest write, so an idle tenant leaves nothing
behind. A key with limits of its own has the same four counters under its id (never leases); they are checked
and taken in the tenant's script, and adjusted by its reconcile only when that reconcile removed the lease.

Monthly counters are seeded from the database (`quota_store`'s invariants): with a ledger, the reserve script
refuses to count anything for a scope whose `month:<YYYYMM>` key is missing and answers `unseeded`; the store
then reads the ledger and writes `month` and `spend` only if `month` is still missing (another replica may
have seeded meanwhile), and runs the reserve again. A reconcile never creates a missing month key, so a seed
is never added to a counter that a reconcile started from nothing.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import redis.asyncio as redis
from redis.asyncio.client import Pipeline

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
)

_MINUTE_TTL_S = 120
_PING_TIMEOUT_S = 2.0
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

_COUNTER_FUNCTIONS = """
local function over(limit, used, amount)
  local l = tonumber(limit)
  return l >= 0 and used + amount > l
end
local function counters(first)
  local r = {}
  for i = 0, 3 do r[i + 1] = tonumber(redis.call('GET', KEYS[first + i]) or '0') end
  return r
end
local function rejection(first_limit, c, tokens, cost)
  if over(ARGV[first_limit], c[1], 1) then return 'requests' end
  if over(ARGV[first_limit + 1], c[2], tokens) then return 'tokens' end
  if over(ARGV[first_limit + 2], c[3], tokens) then return 'monthly_budget' end
  if over(ARGV[first_limit + 3], c[4], cost) then return 'monthly_spend' end
  return ''
end
local function take(first, tokens, cost, minute_ttl, month_ttl, minute)
  local r = counters(first)
  if minute then
    r[1], r[2] = redis.call('INCR', KEYS[first]), redis.call('INCRBY', KEYS[first + 1], tokens)
    redis.call('EXPIRE', KEYS[first], minute_ttl)
    redis.call('EXPIRE', KEYS[first + 1], minute_ttl)
  end
  r[3], r[4] = redis.call('INCRBY', KEYS[first + 2], tokens), redis.call('INCRBY', KEYS[first + 3], cost)
  redis.call('EXPIRE', KEYS[first + 2], month_ttl)
  redis.call('EXPIRE', KEYS[first + 3], month_ttl)
  return r
end
"""

# KEYS: leases, slots, then req, tok, month, spend of the tenant and (with a key) of the key
# ARGV: max_conc, then rpm, tpm, budget, spend budget of the tenant (2-5) and of the key (6-9) (-1 = unlimited),
#       tokens, spend, id, minute ttl, month ttl, now, lease seconds, slots, has key, seeded months required,
#       interactive (0: a batch line, no slots held and nothing taken of the minute)
_RESERVE = _LEASE_FUNCTIONS + _COUNTER_FUNCTIONS + """
local tokens, cost = tonumber(ARGV[10]), tonumber(ARGV[11])
local now, lease, k = tonumber(ARGV[15]), tonumber(ARGV[16]), tonumber(ARGV[17])
local has_key = ARGV[18] == '1'
local interactive = ARGV[20] == '1'
if not interactive then k = 0 end
if ARGV[19] == '1' then
  if redis.call('EXISTS', KEYS[5]) == 0 then return {'unseeded', 'tenant'} end
  if has_key and redis.call('EXISTS', KEYS[9]) == 0 then return {'unseeded', 'key'} end
end
drop_expired(KEYS[1], KEYS[2], now)
local conc = redis.call('ZCARD', KEYS[2])
local outstanding = redis.call('ZCARD', KEYS[1])
local t = counters(3)
local kc = {0, 0, 0, 0}
if has_key then kc = counters(7) end
local rejected, scope = '', 'tenant'
if over(ARGV[1], conc, k) then rejected = 'concurrency' else rejected = rejection(2, t, tokens, cost) end
if rejected == '' and has_key then
  rejected = rejection(6, kc, tokens, cost)
  if rejected ~= '' then scope = 'key' end
end
if rejected == '' then
  write_lease(KEYS[1], KEYS[2], ARGV[12], k, now + lease, lease)
  conc, outstanding = conc + k, outstanding + 1
  t = take(3, tokens, cost, ARGV[13], ARGV[14], interactive)
  if has_key then kc = take(7, tokens, cost, ARGV[13], ARGV[14], interactive) end
end
return {rejected, scope, conc, outstanding, t[1], t[2], t[3], t[4], kc[1], kc[2], kc[3], kc[4]}
"""

# KEYS: month, spend of one scope · ARGV: tokens, spend, month ttl
_SEED = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
return 1
"""
_MAX_SEED_ROUNDS = 4  # tenant, key, and a month that rolled over in between

# KEYS: leases, slots · ARGV: id, now, lease seconds, slots
_RENEW = _LEASE_FUNCTIONS + """
local now, lease = tonumber(ARGV[2]), tonumber(ARGV[3])
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not expiry or tonumber(expiry) <= now then return 0 end
write_lease(KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[4]), now + lease, lease)
return 1
"""

# KEYS: leases, slots, then tok (the reservation's minute), month, spend (its month) of the tenant and (with a
#       key) of the key · ARGV: id, reserved, actual, now, slots, spend delta, has key
_RECONCILE = _LEASE_FUNCTIONS + """
drop_expired(KEYS[1], KEYS[2], ARGV[4])
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
for i = 0, tonumber(ARGV[5]) - 1 do redis.call('ZREM', KEYS[2], ARGV[1] .. ':' .. i) end
local delta, spend_delta = tonumber(ARGV[3]) - tonumber(ARGV[2]), tonumber(ARGV[6])
local function adjust(key, d)
  if d ~= 0 and redis.call('EXISTS', key) == 1 then redis.call('INCRBY', key, d) end
end
local last = 5
if ARGV[7] == '1' then last = 8 end
for first = 3, last, 3 do
  adjust(KEYS[first], delta)
  adjust(KEYS[first + 1], delta)
  adjust(KEYS[first + 2], spend_delta)
end
return 1
"""


def _month_ttl(w: QuotaWindows) -> int:
    return math.ceil(w.month_resets_in) + _MONTH_EXTRA_TTL_S


def _limit(value: int | None) -> int:
    return -1 if value is None else value


def _window_limits(limits: QuotaLimits) -> list[int]:
    """The script's limits of one scope, in its order: requests, tokens, month tokens, month spend."""
    return [
        _limit(limits.requests_per_minute),
        _limit(limits.tokens_per_minute),
        _limit(limits.monthly_token_budget),
        _limit(limits.monthly_spend_budget_micros),
    ]


def _usage(concurrent: int, outstanding: int, counts: list, w: QuotaWindows) -> QuotaUsage:
    """A snapshot from one scope's four counters (requests, tokens, month tokens, month spend)."""
    reqs, toks, month, spend = (int(v or 0) for v in counts)
    return QuotaUsage(
        concurrent=concurrent,
        outstanding=outstanding,
        requests_this_minute=reqs,
        tokens_this_minute=toks,
        tokens_this_month=month,
        minute_resets_in=w.minute_resets_in,
        month_resets_in=w.month_resets_in,
        spend_this_month=spend,
    )


class RedisQuotaStore:
    """Quota counters in Redis. `client` must decode responses (`decode_responses=True`)."""

    def __init__(
        self,
        client: redis.Redis,
        key_prefix: str,
        clock: Callable[[], float] = time.time,
        lease_s: float = DEFAULT_LEASE_S,
        ledger: MonthLedger | None = None,
    ) -> None:
        self._redis = client
        self._prefix = key_prefix
        self._clock = clock
        self.lease_s = lease_s
        self._ledger = ledger
        self._reserve = client.register_script(_RESERVE)
        self._seed = client.register_script(_SEED)
        self._renew = client.register_script(_RENEW)
        self._reconcile = client.register_script(_RECONCILE)

    @classmethod
    def from_url(
        cls,
        url: str,
        key_prefix: str,
        clock: Callable[[], float] = time.time,
        lease_s: float = DEFAULT_LEASE_S,
        ledger: MonthLedger | None = None,
    ) -> RedisQuotaStore:
        return cls(redis.Redis.from_url(url, decode_responses=True), key_prefix, clock, lease_s, ledger)

    def _key(self, tenant_id: str, name: str) -> str:
        return f"{self._prefix}quota:{tenant_id}:{name}"

    def _counter_keys(self, scope_id: str, w: QuotaWindows) -> list[str]:
        names = (f"req:{w.minute}", f"tok:{w.minute}", f"month:{w.month}", f"spend:{w.month}")
        return [self._key(scope_id, n) for n in names]

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
        spend = 0 if rate is None else rate.cost(tokens)
        for _ in range(_MAX_SEED_ROUNDS):
            now = self._clock()
            w = QuotaWindows.at(now)
            keys = [self._key(tenant_id, "leases"), self._key(tenant_id, "slots"), *self._counter_keys(tenant_id, w)]
            key_limits = QuotaLimits() if key is None else key.limits
            if key is not None:
                keys += self._counter_keys(key.key_id, w)
            args = [
                _limit(limits.max_concurrent_requests),
                *_window_limits(limits),
                *_window_limits(key_limits),
                tokens,
                spend,
                reservation_id,
                _MINUTE_TTL_S,
                _month_ttl(w),
                repr(now),
                self.lease_s,
                slots,
                int(key is not None),
                int(self._ledger is not None),
                int(interactive),
            ]
            rejected, scope, *rest = await self._reserve(keys=keys, args=args)
            if rejected != "unseeded":
                break
            await self._seed_month(scope, tenant_id if scope == "tenant" else key.key_id, w)
        else:
            raise RuntimeError(f"quota counters of {tenant_id!r} could not be seeded for {w.month}")
        conc, outstanding, *counts = rest
        rejected_by: Rejection | None = rejected or None
        reservation = None
        if rejected_by is None:
            key_id = None if key is None else key.key_id
            minute, held = (w.minute, slots) if interactive else (-1, 0)
            reservation = Reservation(reservation_id, tenant_id, tokens, minute, w.month, held, key_id, spend, rate)
        usage = _usage(int(conc), int(outstanding), counts[:4], w)
        key_state = None if key is None else ScopeState(key.limits, _usage(0, 0, counts[4:], w))
        return Decision(reservation, rejected_by, usage, limits, scope, key_state)

    async def _seed_month(self, scope: Scope, scope_id: str, w: QuotaWindows) -> None:
        """Write the scope's month counters from the ledger, unless another caller has written them since."""
        assert self._ledger is not None
        totals = await self._ledger.month_to_date(scope, scope_id, w.month)
        keys = [self._key(scope_id, f"month:{w.month}"), self._key(scope_id, f"spend:{w.month}")]
        await self._seed(keys=keys, args=[totals.tokens, totals.spend, _month_ttl(w)])

    async def renew(self, reservation: Reservation) -> bool:
        keys = [self._key(reservation.tenant_id, "leases"), self._key(reservation.tenant_id, "slots")]
        args = [reservation.id, repr(self._clock()), self.lease_s, reservation.slots]
        return bool(await self._renew(keys=keys, args=args))

    async def reconcile(self, reservation: Reservation, actual_tokens: int, actual_cost: int | None = None) -> bool:
        keys, args = self._reconcile_call(reservation, actual_tokens, actual_cost)
        return bool(await self._reconcile(keys=keys, args=args))

    def queue_reconcile(
        self, pipe: Pipeline, reservation: Reservation, actual_tokens: int, actual_cost: int | None = None
    ) -> None:
        """Queue `reconcile` on `pipe` (a pipeline to this store's Redis): it runs when the pipeline does, before
        the commands queued after it; its reply (1: reconciled now, 0: already) is the pipeline's at that place.
        Queued as EVAL of the script's text, not as a registered script: a pipeline holding registered scripts
        asks Redis whether they are loaded first (`SCRIPT EXISTS`), one more round trip per execution."""
        keys, args = self._reconcile_call(reservation, actual_tokens, actual_cost)
        pipe.eval(_RECONCILE, len(keys), *keys, *args)

    def _reconcile_call(
        self, reservation: Reservation, actual_tokens: int, actual_cost: int | None
    ) -> tuple[list[str], list[object]]:
        t, month = reservation.tenant_id, reservation.month
        keys = [self._key(t, "leases"), self._key(t, "slots")]
        for scope_id in (t, reservation.key_id) if reservation.key_id is not None else (t,):
            keys += [
                self._key(scope_id, f"tok:{reservation.minute}"),
                self._key(scope_id, f"month:{month}"),
                self._key(scope_id, f"spend:{month}"),
            ]
        args: list[object] = [
            reservation.id,
            reservation.tokens,
            actual_tokens,
            repr(self._clock()),
            reservation.slots,
            reservation.spend_delta(actual_tokens, actual_cost),
            int(reservation.key_id is not None),
        ]
        return keys, args

    async def usage(self, scope_id: str) -> QuotaUsage:
        """A read-only snapshot: leases past their expiry are not counted (the next write drops them)."""
        now = self._clock()
        w = QuotaWindows.at(now)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.mget(self._counter_keys(scope_id, w))
            pipe.zcount(self._key(scope_id, "slots"), f"({now!r}", "+inf")
            pipe.zcount(self._key(scope_id, "leases"), f"({now!r}", "+inf")
            values, live_slots, live_leases = await pipe.execute()
        return _usage(int(live_slots), int(live_leases), values, w)

    async def ping(self) -> bool:
        try:
            return bool(await asyncio.wait_for(self._redis.ping(), _PING_TIMEOUT_S))
        except (redis.RedisError, OSError, TimeoutError):
            return False

    async def close(self) -> None:
        await self._redis.aclose()
