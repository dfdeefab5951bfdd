"""`/v1/usage` and `/admin/usage` validate their query: a bad value is a 400 naming it, never a 500 or a
silently dropped value; the whole representable time range is accepted.
"""

from __future__ import annotations

import pytest

from pagewise.platform.usage.service import MAX_UNIX_TIME

from ..harness import Platform, bearer

pytestmark = pytest.mark.anyio

DAY = 86_400
BAD_PARAMS = [
    ({"start_time": -1}, "start_time"),
    ({"start_time": MAX_UNIX_TIME + 1}, "start_time"),
    ({"start_time": 0, "end_time": MAX_UNIX_TIME + 1}, "end_time"),
    ({"start_time": "soon"}, "start_time"),
    ({"bucket_width": "1w"}, "bucket_width"),
    ({"group_by": "project_id"}, "group_by"),
    ({"start_time": DAY, "end_time": DAY}, "end_time"),
]


async def _get(platform: Platform, path: str, key: str, params: dict) -> tuple[int, dict]:
    response = await platform.http.get(path, params=params, headers=bearer(key))
    return response.status_code, response.json()


async def test_bad_params_are_400s_naming_them(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    tenant_only = [({"group_by": ["model", "tenant_id"]}, "group_by")]
    for path, caller, cases in (
        ("/v1/usage", key, BAD_PARAMS + tenant_only),
        ("/admin/usage", platform.admin_key, BAD_PARAMS),
    ):
        for params, param in cases:
            status, body = await _get(platform, path, caller, params)
            assert (status, body["error"]["param"]) == (400, param), (path, params, body)


async def test_ranges_up_to_the_last_representable_second(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    for path, caller, group_by in (
        ("/v1/usage", key, ["model"]),
        ("/admin/usage", platform.admin_key, ["tenant_id", "model"]),
    ):
        for width, start, num_buckets in (("1h", MAX_UNIX_TIME - 3600, 2), ("1d", MAX_UNIX_TIME - DAY, 2)):
            params = {"start_time": start, "end_time": MAX_UNIX_TIME, "bucket_width": width, "group_by": group_by}
            status, body = await _get(platform, path, caller, params)
            assert status == 200, (path, params, body)
            assert len(body["data"]) == num_buckets and body["data"][-1]["end_time"] > MAX_UNIX_TIME
        status, body = await _get(platform, path, caller, {"start_time": 0, "end_time": 2 * DAY})
        assert (status, [b["start_time"] for b in body["data"]]) == (200, [0, DAY])
