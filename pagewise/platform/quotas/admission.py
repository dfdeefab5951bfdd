"""Requests no quota window can ever admit: a 400 before reserving, not a 429 the caller would retry.

Invariant: `never_fits(limits, tokens, slots)` is not `None` exactly when the request alone, on counters all at
zero, exceeds `max_concurrent_requests`, `tokens_per_minute` or `monthly_token_budget`; the error names that
limit and the field to lower. It reads no counters and changes nothing.
"""

from __future__ import annotations

from pagewise.platform.errors import APIError, invalid_request
from pagewise.platform.quotas.quota_store import QuotaLimits

REQUEST_EXCEEDS_LIMIT = "request_exceeds_limit"


def never_fits(limits: QuotaLimits, tokens: int, slots: int) -> APIError | None:
    """The 400 for a request of `tokens` tokens (prompts plus `max_tokens` per sample) and `slots` concurrent
    sequences that exceeds a limit on its own; `None` if it could be admitted once the windows have room.

    `requests_per_minute = 0` is not covered: that tenant is blocked, and the 429 says so.
    """
    if limits.max_concurrent_requests is not None and slots > limits.max_concurrent_requests:
        return invalid_request(
            f"This request runs {slots:,} sequences at once (prompts × n) but the tenant's "
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
                f"This request reserves {tokens:,} tokens (prompts plus max_tokens per sample) but the tenant's "
                f"{name} is {limit:,}; lower max_tokens or shorten the prompt",
                param="max_tokens",
                code=REQUEST_EXCEEDS_LIMIT,
            )
    return None
