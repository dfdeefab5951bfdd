"""Rate-limit headers (`x-ratelimit-*`, OpenAI's names) for admitted and rejected requests; the 429."""

from __future__ import annotations

import math

from pagewise.platform.errors import APIError
from pagewise.platform.quotas.quota_store import Decision


def format_reset(seconds: float) -> str:
    """OpenAI's duration format: `12s`, `1m30s`."""
    whole = max(0, math.ceil(seconds))
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


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


def quota_exceeded(decision: Decision, requested_tokens: int) -> APIError:
    """The 429 for a rejected reservation, with `Retry-After` and the rate-limit headers."""
    limits, usage = decision.limits, decision.usage
    match decision.rejected_by:
        case "concurrency":
            retry_after, code = 1, "rate_limit_exceeded"
            message = f"Too many concurrent requests: limit {limits.max_concurrent_requests}"
        case "requests":
            retry_after, code = usage.minute_resets_in, "rate_limit_exceeded"
            message = f"Rate limit reached for requests per minute: limit {limits.requests_per_minute}"
        case "tokens":
            retry_after, code = usage.minute_resets_in, "rate_limit_exceeded"
            message = (
                f"Rate limit reached for tokens per minute: limit {limits.tokens_per_minute}, "
                f"used {usage.tokens_this_minute}, requested {requested_tokens}"
            )
        case _:
            retry_after, code = usage.month_resets_in, "insufficient_quota"
            message = (
                f"Monthly token budget exhausted: budget {limits.monthly_token_budget}, "
                f"used {usage.tokens_this_month}, requested {requested_tokens}"
            )
    headers = {"Retry-After": str(max(1, math.ceil(retry_after))), **rate_limit_headers(decision)}
    return APIError(
        429,
        message,
        code=code,
        type="rate_limit_error" if code == "rate_limit_exceeded" else code,
        headers=headers,
    )
