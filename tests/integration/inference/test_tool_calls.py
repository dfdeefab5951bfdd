"""Tool calling on the real model: `required` and named choices come back as calls whose arguments validate
against the function's parameters (whole or streamed); `auto` answers a conversation that carries earlier calls
and their results; inconsistent tool requests are 400s naming the field, and store nothing."""

from __future__ import annotations

import json

import jsonschema
import pytest

from ..harness import Platform, bearer, chat_body
from .test_openai_api import sse_events

pytestmark = pytest.mark.anyio

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]
ASK = "What is the weather in Paris?"


async def test_required_returns_calls_that_validate(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    body = chat_body(ASK, max_tokens=80, tools=TOOLS[:1], tool_choice="required", parallel_tool_calls=False)
    response = await platform.http.post("/v1/chat/completions", json=body, headers=bearer(key))
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)


async def test_a_named_choice_calls_that_function_streamed(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    named = {"type": "function", "function": {"name": "get_time"}}
    body = chat_body(ASK, max_tokens=60, tools=TOOLS, tool_choice=named, stream=True)
    response = await platform.http.post("/v1/chat/completions", json=body, headers=bearer(key))
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    deltas = [c for e in events[:-1] for c in e["choices"]]
    assert all(not d["delta"].get("content") for d in deltas)  # a call streams no content
    [last] = [d for d in deltas if d["finish_reason"]]
    assert last["finish_reason"] == "tool_calls"
    pieces = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
    first, rest = pieces[0], pieces[1:]  # the name and id first, then the arguments as they were generated
    assert first["index"] == 0 and first["function"] == {"name": "get_time", "arguments": ""}
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in rest)
    assert isinstance(json.loads("".join(p["function"]["arguments"] for p in rest)), dict)


async def test_auto_answers_a_conversation_with_earlier_calls(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    earlier = {"id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [earlier]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    body = chat_body(max_tokens=30, tools=TOOLS, messages=messages)
    response = await platform.http.post("/v1/chat/completions", json=body, headers=bearer(key))
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    message = choice["message"]
    if choice["finish_reason"] == "tool_calls":
        assert message["content"] is None and message["tool_calls"]
    else:
        assert message["content"] and "tool_calls" not in message


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
        ({"parallel_tool_calls": True}, "parallel_tool_calls"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
async def test_inconsistent_tool_requests_are_refused(platform: Platform, extra: dict, param: str) -> None:
    _, key = await platform.tenant_with_key()
    response = await platform.http.post("/v1/chat/completions", json=chat_body(**extra), headers=bearer(key))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
