"""Requests no quota window can ever admit: a 400 before reserving, not a 429 the caller would retry.

Invariant: `never_fits(limits, tokens, slots, spend)` is not `None` exactly when the request alone, on counters all
at zero, exceeds `max_concurrent_requests`, `tokens_per_minute`, `monthly_token_budget` or
`monthly_spend_budget_micros` of the scope (`tenant` or `key`) whose limits these are; the error names that limit,
whose it is and the field to lower. It reads no counters and changes nothing.
"""

from __future__ import annotations

from pagewise.platform.billing.money import format_dollars
from pagewise.platform.errors import APIError, invalid_request
from pagewise.platform.quotas.quota_store import QuotaLimits, Scope

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
