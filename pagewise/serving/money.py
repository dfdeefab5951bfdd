"""Money is integer micro-dollars (1 USD = 1,000,000), never a float.

Invariant: a request's cost is rounded once, to the nearest micro-dollar (half up), from the exact product of its
tokens and its per-million-token prices; every total above it (usage_daily, exports, budgets) adds those
integers, so every total reconciles exactly with the rows it sums.
"""

from __future__ import annotations

import decimal

MICROS_PER_DOLLAR = 1_000_000
TOKENS_PER_PRICE_UNIT = 1_000_000  # prices are per million tokens


def micros_for(token_price_product: int) -> int:
    """Whole micro-dollars for a sum of `tokens × micro-dollars per million tokens`, rounded half up."""
    return (token_price_product + TOKENS_PER_PRICE_UNIT // 2) // TOKENS_PER_PRICE_UNIT


def parse_dollars(text: str, what: str) -> int:
    """`"0.15"` → 150000 micro-dollars; a `ValueError` naming `what` for anything else (negative, finer than a
    micro-dollar, not a number)."""
    try:
        value = decimal.Decimal(text.strip())
    except decimal.InvalidOperation:
        raise ValueError(f"{what} must be a dollar amount such as 0.15; got {text!r}") from None
    micros = value * MICROS_PER_DOLLAR
    if not value.is_finite() or value < 0 or micros != micros.to_integral_value():
        raise ValueError(f"{what} must be a non-negative dollar amount with at most 6 decimals; got {text!r}")
    return int(micros)


def format_dollars(micros: int) -> str:
    """Exact dollars with six decimals: 1234567 → `"1.234567"`."""
    sign = "-" if micros < 0 else ""
    whole, fraction = divmod(abs(micros), MICROS_PER_DOLLAR)
    return f"{sign}{whole}.{fraction:06d}"
