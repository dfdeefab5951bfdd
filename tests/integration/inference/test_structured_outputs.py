"""Structured outputs over HTTP on the real model: OpenAI's `response_format` (`json_schema`, `json_object`) and
vLLM's `structured_outputs`, streamed or not, on both endpoints; every answer validates against its schema, and
one cut short by `max_tokens` says `length`."""

from __future__ import annotations

import json

import jsonschema
import pytest

from ..harness import MODEL, Platform, bearer, chat_body
from .test_openai_api import sse_events

pytestmark = pytest.mark.anyio

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}


async def test_chat_json_schema_validates_streamed_or_not(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    body = chat_body("Name a large city and its population, as JSON.", max_tokens=80, response_format=JSON_SCHEMA)
    whole = await platform.http.post("/v1/chat/completions", json=body, headers=bearer(key))
    assert whole.status_code == 200, whole.text
    [choice] = whole.json()["choices"]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), CITY)

    streamed = await platform.http.post(
        "/v1/chat/completions", json=body | {"stream": True, "n": 2, "temperature": 0.9, "seed": 5}, headers=bearer(key)
    )
    texts: dict[int, str] = {0: "", 1: ""}
    for event in sse_events(streamed.text)[:-1]:
        for delta in event["choices"]:
            texts[delta["index"]] += delta["delta"].get("content") or ""
    for text in texts.values():
        jsonschema.validate(json.loads(text), CITY)


async def test_completions_json_object_and_vllm_choice(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    common = {"model": MODEL, "prompt": "Q: Is water wet?\nA:", "temperature": 0}
    as_object = await platform.http.post(
        "/v1/completions", json=common | {"max_tokens": 120, "response_format": {"type": "json_object"}},
        headers=bearer(key),
    )
    [choice] = as_object.json()["choices"]
    assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["text"]), dict), choice
    chosen = await platform.http.post(
        "/v1/completions", json=common | {"max_tokens": 5, "structured_outputs": {"choice": ["yes", "no"]}},
        headers=bearer(key),
    )
    assert chosen.json()["choices"][0]["text"] in ("yes", "no")


async def test_a_document_cut_by_max_tokens_says_length(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    body = chat_body("Name a large city and its population, as JSON.", max_tokens=3, response_format=JSON_SCHEMA)
    response = await platform.http.post("/v1/chat/completions", json=body, headers=bearer(key))
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("{")
