"""A flood of wrong keys from one address is refused with 429 before any key lookup, and does not slow a good
key from another address."""

from __future__ import annotations

import httpx
import pytest

from pagewise.platform.keys.auth_throttle import MAX_PER_ADDRESS
from pagewise.platform.keys.key_format import generate_key

from ..harness import Platform, bearer

pytestmark = pytest.mark.anyio


async def test_wrong_keys_from_one_address_are_throttled(platform: Platform) -> None:
    _, good = await platform.tenant_with_key()
    statuses = [
        (await platform.http.get("/v1/models", headers=bearer(generate_key().key))).status_code
        for _ in range(MAX_PER_ADDRESS + 5)
    ]
    assert statuses == [401] * MAX_PER_ADDRESS + [429] * 5
    refused = await platform.http.get("/v1/models", headers=bearer(good))
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1  # that address, any key
    elsewhere = httpx.AsyncClient(transport=httpx.ASGITransport(app=platform.app, client=("10.9.8.7", 4000)),
                                  base_url="http://test")
    async with elsewhere as http:
        assert (await http.get("/v1/models", headers=bearer(good))).status_code == 200
