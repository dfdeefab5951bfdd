"""Rate-limit headers (`x-ratelimit-*`, OpenAI's names) for admitted and rejected requests; the 429.

Invariant: a 429's message names the one limit that refused and states that limit, what is used or held,
what remains, what the request asked for and when the window resets — the numbers the headers carry too.
"""

from __future__ import annotations

import math

from pagewise.platform.errors import APIError
from pagewise.platform.quotas.quota_store import Decision


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
    """Headers for the limits the tenant has; an unlimited dimension sends none."""
    limits, usage = decision.limits, decision.usage
    headers: dict[str, str] = {}
    reset = format_reset(usage.minute_resets_in)
    if limits.requests_per_minute is not None:
        headers["x-ratelimit-limit-requests"] = str(limits.requests_per_minute)
        headers["x-ratelimit-remaining-requests"] = str(
            max(0, limits.requests_per_minute - usage.requests_this_minute)
        )
        headers["x-ratelimit-reset-requests"] = reset
    if limits.tokens_per_minute is not None:
        headers["x-ratelimit-limit-tokens"] = str(limits.tokens_per_minute)
        headers["x-ratelimit-remaining-tokens"] = str(
            max(0, limits.tokens_per_minute - usage.tokens_this_minute)
        )
        headers["x-ratelimit-reset-tokens"] = reset
    return headers


def _window_message(what: str, limit: int, used: int, requested: int, resets_in: float) -> str:
    remaining = max(0, limit - used)
    return (
        f"{what}: limit {limit:,}, used {used:,}, remaining {remaining:,}, requested {requested:,}; "
        f"resets in {format_reset(resets_in)}"
    )


def quota_exceeded(decision: Decision, requested_tokens: int, requested_slots: int = 1) -> APIError:
    """The 429 for a rejected reservation of `requested_tokens` tokens and `requested_slots` slots.

    Carries `Retry-After` and the rate-limit headers; `requested_slots` defaults to 1 like `reserve`'s.
    """
    limits, usage = decision.limits, decision.usage
    code = "rate_limit_exceeded"
    match decision.rejected_by:
        case "concurrency":
            retry_after = 1
            message = (
                f"Concurrency limit reached: limit {limits.max_concurrent_requests:,}, "
                f"in use {usage.concurrent:,}, requested {requested_slots:,}; "
                "retry when a running request finishes"
            )
        case "requests":
            retry_after = usage.minute_resets_in
            message = _window_message(
                "Rate limit reached for requests per minute",
                limits.requests_per_minute or 0,
                usage.requests_this_minute,
                1,
                usage.minute_resets_in,
            )
        case "tokens":
            retry_after = usage.minute_resets_in
            message = _window_message(
                "Rate limit reached for tokens per minute",
                limits.tokens_per_minute or 0,
                usage.tokens_this_minute,
                requested_tokens,
                usage.minute_resets_in,
            )
        case _:
            retry_after, code = usage.month_resets_in, "insufficient_quota"
            message = _window_message(
                "Monthly token budget exhausted",
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
