"""Keyset pages, OpenAI's list shape: `data`, `first_id`, `last_id`, `has_more` (one home for every listing)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class _HasId(Protocol):
    id: str


def page_fields(items: Sequence[_HasId], fetched: int, limit: int) -> dict[str, Any]:
    """The fields of a page of `items` (at most `limit`), read from `fetched` rows: a query asks for `limit + 1`,
    and the extra row only tells whether there is more."""
    return {
        "data": list(items),
        "first_id": items[0].id if items else None,
        "last_id": items[-1].id if items else None,
        "has_more": fetched > limit,
    }
