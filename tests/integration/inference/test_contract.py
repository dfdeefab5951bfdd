"""The API's contract at the edge: strict bodies, no 5xx on client input, headers every response carries.

Every refused body leaves no row behind and takes no quota (checked once per case).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import func, select

from pagewise.platform.db.models import RequestRecord

from ..harness import MODEL, Platform, bearer, chat_body

pytestmark = pytest.mark.anyio


async def _rows(platform: Platform, tenant_id: str) -> int:
    async with platform.services.sessionmaker() as session:
        query = select(func.count()).select_from(RequestRecord).where(RequestRecord.tenant_id == tenant_id)
        return await session.scalar(query) or 0


UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}  # a keyword it cannot enforce


def _completion(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **extra}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            chat_body(tools=[{"type": "function", "function": {"name": "f", "parameters": UNIQUE}}],
                      tool_choice="required"),
            "tools",
        ),
        ("/v1/chat/completions", chat_body(tool_choice="required"), "tool_choice"),
        (
            "/v1/chat/completions",
            chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": UNIQUE}}),
            "response_format.json_schema.schema",
        ),
        ("/v1/completions", _completion(structured_outputs={"regex": "(a"}), "structured_outputs.regex"),
        (
            "/v1/completions",
            _completion(response_format={"type": "json_object"}, structured_outputs={"choice": ["a"]}),
            "response_format",
        ),
        ("/v1/chat/completions", chat_body(parallel_tool_calls=True), "parallel_tool_calls"),
        ("/v1/chat/completions", chat_body(stream_options={"include_usage": True, "x": 1}), "stream_options.x"),
        ("/v1/completions", _completion(echo=True), "echo"),
        ("/v1/completions", _completion(suffix="!"), "suffix"),
        ("/v1/completions", _completion(best_of=2), "best_of"),
        ("/v1/completions", _completion(temprature=0.5), "temprature"),
    ],
)
async def test_unknown_and_unsupported_fields_are_named(
    platform: Platform, path: str, body: dict[str, Any], param: str
) -> None:
    tenant, key = await platform.tenant_with_key()
    response = await platform.http.post(path, json=body, headers=bearer(key))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert await _rows(platform, tenant["id"]) == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", "inf"), ("temperature", "0.5"), ("max_tokens", "4"), ("n", "1"), ("stream", "true"),
     ("seed", "7"), ("top_p", "NaN"), ("max_tokens", True), ("n", 1.0)],
)
async def test_no_coercion_from_strings_or_other_types(platform: Platform, field: str, value: Any) -> None:
    tenant, key = await platform.tenant_with_key()
    response = await platform.http.post("/v1/chat/completions", json=chat_body(**{field: value}), headers=bearer(key))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    assert await _rows(platform, tenant["id"]) == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", "1e999"), ("top_p", "-1e999"), ("seed", -1), ("seed", 2**64), ("top_k", -2),
     ("repetition_penalty", 0), ("frequency_penalty", 3), ("min_tokens", 10), ("stop", ["x"] * 17), ("stop", "y" * 300),
     ("logit_bias", {"abc": 1}), ("logit_bias", {"1": 101}), ("stop_token_ids", [10**9]), ("user", "u" * 300)],
)
async def test_out_of_range_values_are_400(platform: Platform, field: str, value: Any) -> None:
    tenant, key = await platform.tenant_with_key()
    body = chat_body(**{field: 0 if field in ("temperature", "top_p") else value})  # max_tokens=4 < min_tokens
    raw = json.dumps(body)
    if field in ("temperature", "top_p"):  # JSON numbers that overflow a double: +-inf once decoded
        raw = raw.replace(f'"{field}": 0', f'"{field}": {value}')
    headers = {**bearer(key), "Content-Type": "application/json"}
    response = await platform.http.post("/v1/chat/completions", content=raw, headers=headers)
    assert response.status_code == 400, response.text
    assert await _rows(platform, tenant["id"]) == 0


async def test_seed_at_the_edge_of_its_range_runs_and_engine_keeps_serving(platform: Platform) -> None:
    """`seed + n - 1` must fit 64 bits: the last valid seed runs; one past it is refused, never raised in the
    engine (where it once killed the loop for every tenant)."""
    _, key = await platform.tenant_with_key()
    top = 2**64 - 1
    ok = await platform.http.post(
        "/v1/completions", json=_completion(seed=top - 1, n=2, temperature=1.0), headers=bearer(key)
    )
    assert ok.status_code == 200, ok.text
    refused = await platform.http.post("/v1/completions", json=_completion(seed=top, n=2), headers=bearer(key))
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "seed"
    _, other = await platform.tenant_with_key()
    again = await platform.http.post("/v1/completions", json=_completion(), headers=bearer(other))
    assert again.status_code == 200, again.text
    assert (await platform.http.get("/ready")).status_code == 200


async def test_deeply_nested_json_is_400(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    headers = {**bearer(key), "Content-Type": "application/json"}
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"model": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_001):
        response = await platform.http.post("/v1/chat/completions", content=body, headers=headers)
        assert response.status_code == 400, response.text[:200]
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/requests", "/admin/tenants", "/v1/usage", "/health"])
async def test_options_is_never_a_server_error(platform: Platform, path: str) -> None:
    response = await platform.http.options(path, headers=bearer(platform.admin_key))
    assert response.status_code < 500, response.text
    assert "Internal" not in response.text


@pytest.mark.parametrize(
    "target",
    ["/v1/requests/req%00x", "/v1/requests?after=cmpl_%00", "/admin/tenants/ten%00", "/admin/requests?tenant_id=%00"],
)
async def test_nul_bytes_in_path_or_query_are_400(platform: Platform, target: str) -> None:
    response = await platform.http.get(target, headers=bearer(platform.admin_key))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "nul_byte"


async def test_security_headers_on_every_response(platform: Platform) -> None:
    for response in (
        await platform.http.get("/health"),
        await platform.http.get("/v1/models"),  # 401: no key
        await platform.http.get("/no/such/route"),
    ):
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["x-frame-options"] == "DENY"
        assert response.headers["referrer-policy"] == "no-referrer"
        assert response.headers["content-security-policy"].startswith("default-src 'none'")


async def test_vllm_sampling_extensions(platform: Platform) -> None:
    """`logit_bias`, `min_tokens`, `stop_token_ids` and `include_stop_str_in_output` are honoured, not ignored."""
    _, key = await platform.tenant_with_key()

    async def complete(**extra: Any) -> dict[str, Any]:
        response = await platform.http.post(
            "/v1/completions", json=_completion(temperature=0, **extra), headers=bearer(key)
        )
        assert response.status_code == 200, response.text
        return response.json()

    token = platform.services.engine.encode(" pagewise")[-1]
    bias = {str(token): 100}
    kept = await complete(max_tokens=5, logit_bias=bias, stop_token_ids=[token], include_stop_str_in_output=True)
    token_text = kept["choices"][0]["text"]
    assert token_text and kept["usage"]["completion_tokens"] == 1
    forced = await complete(max_tokens=3, logit_bias=bias, ignore_eos=True)
    assert forced["choices"][0]["text"] == token_text * 3
    stopped = await complete(max_tokens=5, logit_bias=bias, stop_token_ids=[token])
    assert (stopped["choices"][0]["text"], stopped["choices"][0]["finish_reason"]) == ("", "stop")
    [eos] = platform.services.engine.encode("<|im_end|>")
    assert (await complete(max_tokens=4, logit_bias={str(eos): 100}))["usage"]["completion_tokens"] == 1
    delayed = await complete(max_tokens=4, min_tokens=3, logit_bias={str(eos): 100})
    assert delayed["usage"]["completion_tokens"] >= 3
