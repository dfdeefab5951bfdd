"""The served model's price, shared by the billing tests (prices are global: one per database)."""

from __future__ import annotations

from typing import Any

from ..harness import MODEL, Platform, bearer

PRICE = {"input": 2, "cached_input": 1, "output": 8}  # dollars per million tokens, as the API takes them


def micros(price: dict[str, Any], field: str) -> int:
    """A price field of `PRICE` or of a price body (dollars per million tokens) in micro-dollars."""
    return round(price[field] * 1_000_000)


async def ensure_price(platform: Platform) -> dict[str, Any]:
    """`PRICE` for the served model ($2 / $1 cached / $8 per million tokens), created once per database."""
    admin = bearer(platform.admin_key)
    listed = (await platform.http.get("/admin/prices", params={"model": MODEL}, headers=admin)).json()
    if listed:
        return listed[0]
    response = await platform.http.post("/admin/prices", json={"model": MODEL, **PRICE}, headers=admin)
    assert response.status_code == 201, response.text
    return response.json()
