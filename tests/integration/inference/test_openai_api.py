"""The OpenAI-compatible API on the real model: shapes, streaming, n > 1, stop, logprobs, usage."""

from __future__ import annotations

import json

import pytest

from pagewise.platform.inference.schemas import MAX_PROMPTS

from ..harness import MODEL, Platform, bearer, chat_body

pytestmark = pytest.mark.anyio


def sse_events(text: str) -> list[dict | str]:
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


async def test_chat_completion(platform: Platform) -> None:
    _, key = await platform.tenant_with_key(requests_per_minute=100, tokens_per_minute=100_000)
    response = await platform.http.post(
        "/v1/chat/completions", json=chat_body(max_tokens=3), headers=bearer(key)
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert (
        body["object"] == "chat.completion" and body["model"] == MODEL and body["id"].startswith("chatcmpl-")
    )
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["completion_tokens"] <= 3 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "cached_tokens" in usage["prompt_tokens_details"]
    assert response.headers["x-ratelimit-limit-requests"] == "100"
    assert response.headers["x-ratelimit-remaining-requests"] == "99"
    assert response.headers["x-ratelimit-limit-tokens"] == "100000"
    assert int(response.headers["x-ratelimit-remaining-tokens"]) < 100_000
    assert response.headers["x-ratelimit-reset-requests"].endswith("s")
    row = (await platform.http.get(f"/v1/requests/{body['id']}", headers=bearer(key))).json()
    assert row["status"] == "completed" and row["usage"] == usage
    assert row["output"][0]["text"] == choice["message"]["content"]


async def test_completion_n_and_logprobs(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    body = {
        "model": MODEL,
        "prompt": "The capital of France is",
        "max_tokens": 2,
        "n": 2,
        "temperature": 0.8,
        "seed": 1,
        "logprobs": 2,
    }
    response = await platform.http.post("/v1/completions", json=body, headers=bearer(key))
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["object"] == "text_completion"
    assert [c["index"] for c in result["choices"]] == [0, 1]
    for choice in result["choices"]:
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"])
        assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    assert result["usage"]["completion_tokens"] == sum(
        len(c["logprobs"]["tokens"]) for c in result["choices"]
    )


async def test_completion_prompt_lists(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    body = {"model": MODEL, "prompt": ["One, two,", "Red, green,"], "max_tokens": 2, "temperature": 0}
    result = (await platform.http.post("/v1/completions", json=body, headers=bearer(key))).json()
    assert [c["index"] for c in result["choices"]] == [0, 1]
    ids = (
        await platform.http.post("/v1/completions", json={**body, "prompt": [1, 2, 3]}, headers=bearer(key))
    ).json()
    assert len(ids["choices"]) == 1 and ids["usage"]["prompt_tokens"] == 3
    long_ids = list(range(5, 5 + MAX_PROMPTS + 44))  # one token-id prompt longer than the list-of-prompts cap
    long = await platform.http.post("/v1/completions", json={**body, "prompt": long_ids}, headers=bearer(key))
    assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] == len(long_ids)


async def test_stop_string_ends_the_text(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    probe = (
        await platform.http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 6, "temperature": 0},
            headers=bearer(key),
        )
    ).json()
    text = probe["choices"][0]["text"]
    stop = text.strip()[:1]
    stopped = (
        await platform.http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 6, "temperature": 0, "stop": [stop]},
            headers=bearer(key),
        )
    ).json()
    assert stop not in stopped["choices"][0]["text"]
    assert stopped["choices"][0]["finish_reason"] == "stop"


async def test_chat_streaming_with_usage(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    body = chat_body(max_tokens=3, n=2, stream=True, stream_options={"include_usage": True})
    response = await platform.http.post("/v1/chat/completions", json=body, headers=bearer(key))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert "x-ratelimit-limit-requests" in response.headers
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert {c["choices"][0]["delta"].get("role") for c in chunks[:2]} == {"assistant"}
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(c["choices"][0]["index"] for c in finals) == [0, 1]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] <= 6 and usage["prompt_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_completion_streaming(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "stream": True}
    events = sse_events((await platform.http.post("/v1/completions", json=body, headers=bearer(key))).text)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    plain = (
        await platform.http.post("/v1/completions", json={**body, "stream": False}, headers=bearer(key))
    ).json()
    assert text == plain["choices"][0]["text"]


async def test_models(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    models = (await platform.http.get("/v1/models", headers=bearer(key))).json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert (await platform.http.get(f"/v1/models/{MODEL}", headers=bearer(key))).status_code == 200
    assert (await platform.http.get("/v1/models/gpt-4", headers=bearer(key))).status_code == 404
