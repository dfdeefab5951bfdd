"""Rate-limit headers (`x-ratelimit-*`, OpenAI's names) for admitted and rejected requests; the 429.

Invariant: a 429's message names the one limit that refused and whose it is ("the tenant's limit" or "this API
key's limit") and states that limit, what is used or held, what remains, what the request asked for
and when the window resets — the numbers the headers carry too. With key limits, each header reports the
tighter of the two scopes.
"""

from __future__ import annotations

import math

from pagewise.platform.errors import APIError
from pagewise.platform.quotas.quota_store import Decision, QuotaLimits, QuotaUsage
from pagewise.serving.money import format_dollars


def format_reset(seconds: float) -> str:
    """OpenAI's duration format, rounded up to whole seconds: `12s`, `1m30s`, `3d4h0m5s`."""
    remaining = max(0, math.ceil(seconds))
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        count, remaining = divmod(remaining, size)
        if count or parts:
            parts.append(f"{count}{unit}")
    return "".join(parts) + f"{remaining}s"


def rate_limit_headers(decision: Decision) -> dict[str, str]:
    """Headers for the limits the tenant or its key has; an unlimited dimension sends none."""
    scopes = [(decision.limits, decision.usage)]
    if decision.key is not None:
        scopes.append((decision.key.limits, decision.key.usage))
    headers: dict[str, str] = {}
    for name, limit_of, used_of in (
        ("requests", lambda limits: limits.requests_per_minute, lambda usage: usage.requests_this_minute),
        ("tokens", lambda limits: limits.tokens_per_minute, lambda usage: usage.tokens_this_minute),
    ):
        tightest = _tightest([(limit_of(limits), used_of(usage)) for limits, usage in scopes])
        if tightest is not None:
            limit, remaining = tightest
            headers[f"x-ratelimit-limit-{name}"] = str(limit)
            headers[f"x-ratelimit-remaining-{name}"] = str(remaining)
            headers[f"x-ratelimit-reset-{name}"] = format_reset(decision.usage.minute_resets_in)
    return headers


def _tightest(pairs: list[tuple[int | None, int]]) -> tuple[int, int] | None:
    """(limit, remaining) of the (limit, used) pair with the least remaining; `None` when all are unlimited."""
    limited = [(limit, max(0, limit - used)) for limit, used in pairs if limit is not None]
    return min(limited, key=lambda pair: pair[1]) if limited else None


def _window_message(what: str, limit: int, used: int, requested: int, resets_in: float) -> str:
    remaining = max(0, limit - used)
    return (
        f"{what}: limit {limit:,}, used {used:,}, remaining {remaining:,}, requested {requested:,}; "
        f"resets in {format_reset(resets_in)}"
    )


def quota_exceeded(
    decision: Decision, requested_tokens: int, requested_slots: int = 1, *, requested_spend: int = 0
) -> APIError:
    """The 429 for a rejected reservation of `requested_tokens` tokens, `requested_slots` slots and
    `requested_spend` micro-dollars.

    Carries `Retry-After` and the rate-limit headers; `requested_slots` defaults to 1 like `reserve`'s.
    """
    refusing = decision.refusing
    limits, usage = refusing.limits, refusing.usage
    code = "rate_limit_exceeded"
    whose = " (this API key's limit)" if decision.scope == "key" else " (the tenant's limit)"
    match decision.rejected_by:
        case "concurrency":
            retry_after = 1
            message = (
                f"Concurrency limit reached{whose}: limit {limits.max_concurrent_requests:,}, "
                f"in use {usage.concurrent:,}, requested {requested_slots:,}; "
                "retry when a running request finishes"
            )
        case "requests":
            retry_after = usage.minute_resets_in
            message = _window_message(
                f"Rate limit reached for requests per minute{whose}",
                limits.requests_per_minute or 0,
                usage.requests_this_minute,
                1,
                usage.minute_resets_in,
            )
        case "tokens":
            retry_after = usage.minute_resets_in
            message = _window_message(
                f"Rate limit reached for tokens per minute{whose}",
                limits.tokens_per_minute or 0,
                usage.tokens_this_minute,
                requested_tokens,
                usage.minute_resets_in,
            )
        case "monthly_spend":
            retry_after, code = usage.month_resets_in, "insufficient_quota"
            message = _spend_message(whose, limits, usage, requested_spend)
        case _:
            retry_after, code = usage.month_resets_in, "insufficient_quota"
            message = _window_message(
                f"Monthly token budget exhausted{whose}",
                limits.monthly_token_budget or 0,
                usage.tokens_this_month,
                requested_tokens,
                usage.month_resets_in,
            )
    headers = {"Retry-After": str(max(1, math.ceil(retry_after))), **rate_limit_headers(decision)}
    return APIError(
        429,
        message,
        code=code,
        type="rate_limit_error" if code == "rate_limit_exceeded" else code,
        headers=headers,
    )


def _spend_message(whose: str, limits: QuotaLimits, usage: QuotaUsage, requested: int) -> str:
    """The monthly spend budget's message, in dollars; the request's reservation is its most it can cost."""
    budget, spent = limits.monthly_spend_budget_micros or 0, usage.spend_this_month
    return (
        f"Monthly spend budget exhausted{whose}: limit ${format_dollars(budget)}, "
        f"spent ${format_dollars(spent)}, remaining ${format_dollars(max(0, budget - spent))}, "
        f"this request may cost up to ${format_dollars(requested)}; "
        f"resets in {format_reset(usage.month_resets_in)}"
    )
