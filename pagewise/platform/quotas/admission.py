"""The quota checks that run before `reserve`: refusals decided without taking anything.

Invariants:
- `never_fits(limits, tokens, slots, spend)` is not `None` exactly when the request alone, on counters all at
  zero, exceeds `max_concurrent_requests`, `tokens_per_minute`, `monthly_token_budget` or
  `monthly_spend_budget_micros` of the scope (`tenant` or `key`) whose limits these are: a 400, not a 429 the
  caller would retry. The error names that limit, whose it is and the field to lower. It reads no counters.
- `cheap_refusal` checks the limits that need no token count (concurrency and requests per minute: the tenant's,
  then the key's) on the counters as they are, so a request already bound to be refused costs a counter read
  per scope, not a tokenization. It only reads; `reserve` checks every limit again, atomically.
"""

from __future__ import annotations

import asyncio

from pagewise.platform.errors import APIError, invalid_request
from pagewise.platform.quotas.quota_store import (
    Decision,
    KeyQuota,
    QuotaLimits,
    QuotaStore,
    QuotaUsage,
    Rejection,
    Scope,
    ScopeState,
    first_rejection,
)
from pagewise.serving.money import format_dollars

REQUEST_EXCEEDS_LIMIT = "request_exceeds_limit"
_WHOSE = {"tenant": "the tenant's", "key": "this API key's"}


def never_fits(
    limits: QuotaLimits, tokens: int, slots: int, spend: int = 0, scope: Scope = "tenant"
) -> APIError | None:
    """The 400 for a request of `tokens` tokens (prompts plus `max_tokens` per sample), `slots` concurrent
    sequences and at most `spend` micro-dollars that exceeds a limit on its own; `None` if it could be admitted
    once the windows have room.

    `requests_per_minute = 0` is not covered: that scope is blocked, and the 429 says so.
    """
    whose = _WHOSE[scope]
    if limits.max_concurrent_requests is not None and slots > limits.max_concurrent_requests:
        return invalid_request(
            f"This request runs {slots:,} sequences at once (prompts × n) but {whose} "
            f"max_concurrent_requests limit is {limits.max_concurrent_requests:,}; lower n or send fewer prompts",
            param="n",
            code=REQUEST_EXCEEDS_LIMIT,
        )
    for limit, name in (
        (limits.tokens_per_minute, "tokens_per_minute limit"),
        (limits.monthly_token_budget, "monthly_token_budget"),
    ):
        if limit is not None and tokens > limit:
            return invalid_request(
                f"This request reserves {tokens:,} tokens (prompts plus max_tokens per sample) but {whose} "
                f"{name} is {limit:,}; lower max_tokens or shorten the prompt",
                param="max_tokens",
                code=REQUEST_EXCEEDS_LIMIT,
            )
    budget = limits.monthly_spend_budget_micros
    if budget is not None and spend > budget:
        return invalid_request(
            f"This request may cost up to ${format_dollars(spend)} (prompts plus max_tokens per sample at the "
            f"model's price) but {whose} monthly spend budget is ${format_dollars(budget)}; lower max_tokens or "
            "shorten the prompt",
            param="max_tokens",
            code=REQUEST_EXCEEDS_LIMIT,
        )
    return None


async def cheap_refusal(
    quotas: QuotaStore, tenant_id: str, limits: QuotaLimits, key: KeyQuota | None
) -> Decision | None:
    """The decision refusing one more request of the tenant (`limits`) through `key` on concurrency or requests
    per minute, with `scope` naming whose limit refused; `None` when neither scope refuses (or has such a limit)."""
    tenant_cheap = limits.max_concurrent_requests is not None or limits.requests_per_minute is not None
    key_cheap = key is not None and key.limits.requests_per_minute is not None
    if not (tenant_cheap or key_cheap):
        return None
    if key is not None and key_cheap:
        usage, key_usage = await asyncio.gather(quotas.usage(tenant_id), quotas.usage(key.key_id))
        key_state = ScopeState(key.limits, key_usage)
    else:
        usage, key_state = await quotas.usage(tenant_id), None
    rejected = _cheap_rejection(limits, usage)
    if rejected is not None:
        return Decision(None, rejected, usage, limits, "tenant", key_state)
    rejected = None if key_state is None else _cheap_rejection(key_state.limits, key_state.usage)
    return None if rejected is None else Decision(None, rejected, usage, limits, "key", key_state)


def _cheap_rejection(limits: QuotaLimits, usage: QuotaUsage) -> Rejection | None:
    """Concurrency or requests per minute refusing one more one-slot request on `usage` (tokens not counted)."""
    return first_rejection(limits, 0, 1, usage.concurrent, usage.requests_this_minute, 0, 0)
