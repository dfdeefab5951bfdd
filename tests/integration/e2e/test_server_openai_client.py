"""The real server process (`python -m pagewise.cli serve`) driven by the official `openai` client."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from pagewise.bench.local_server import local_server

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(base URL, admin key): the first start on an empty database stores the key given in PAGEWISE_ADMIN_KEY."""
    workdir = tmp_path_factory.mktemp("server")
    database_url = f"sqlite+aiosqlite:///{workdir / 'e2e.db'}"
    serve = (sys.executable, "-m", "pagewise.cli", "serve")
    exports = {"PAGEWISE_EXPORT_DIR": str(workdir / "exports")}  # uploaded files go there, not to the home folder
    with local_server(workdir, database_url, ["--max-model-len", "512"], command=serve, env=exports) as server:
        yield server.base, server.admin_key
        log = server.log_path
    assert server.admin_key.split("_", 2)[2] not in log.read_text()  # the secret never reaches the output


@pytest.fixture(scope="module")
def client(server: tuple[str, str]) -> openai.OpenAI:
    base, admin_key = server
    admin = {"Authorization": f"Bearer {admin_key}"}
    tenant = httpx.post(f"{base}/admin/tenants", json={"name": "e2e"}, headers=admin).json()
    key = httpx.post(f"{base}/admin/tenants/{tenant['id']}/keys", json={}, headers=admin).json()["key"]
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def test_chat_and_usage(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage.completion_tokens <= 4 and chat.usage.prompt_tokens_details.cached_tokens >= 0
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completions_n_and_stop(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=6, n=2, temperature=0.7, seed=3, stop=["\n"]
    )
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert all("\n" not in c.text for c in result.choices)
    assert result.usage.completion_tokens == result.usage.total_tokens - result.usage.prompt_tokens


def test_streaming_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to 3"}],
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 4
    completion_stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True)
    assert "".join(c.choices[0].text for c in completion_stream if c.choices)


def test_errors_surface_as_openai_exceptions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="hi " * 600, max_tokens=1)
    assert error.value.code == "context_length_exceeded"
    bad = openai.OpenAI(base_url=str(client.base_url), api_key="pw_000000000000_nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    """`client.chat.completions.parse(response_format=Model)`: the client sends the model's strict JSON
    Schema, and what comes back parses into the model."""
    import pydantic

    class City(pydantic.BaseModel):
        name: str
        population: int

    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a large city and its population."}],
        response_format=City,
        max_tokens=60,
        temperature=0,
    )
    [choice] = completion.choices
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)


WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}]


def _weather_call(client: openai.OpenAI, **extra):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=WEATHER_TOOLS,
        tool_choice="required",
        max_tokens=60,
        temperature=0,
        **extra,
    )


def test_tool_calls_through_the_client(client: openai.OpenAI) -> None:
    """`tools` with `tool_choice="required"`: the client reads a typed tool call whose arguments parse."""
    completion = _weather_call(client)
    [choice] = completion.choices
    assert choice.finish_reason == "tool_calls", choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)


def test_streamed_tool_call_arguments_arrive_in_pieces(client: openai.OpenAI) -> None:
    """Streamed, a required call's name comes first and its arguments in fragments, as OpenAI streams them; the
    client's pieces join into arguments that parse."""
    stream = _weather_call(client, stream=True)
    names, ids, pieces, finish = [], set(), [], None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                assert call.index == 0
                if call.id:
                    ids.add(call.id)
                if call.function and call.function.name:
                    names.append(call.function.name)
                if call.function and call.function.arguments:
                    pieces.append(call.function.arguments)
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and names == ["get_weather"] and len(ids) == 1
    assert len(pieces) > 1
    assert isinstance(json.loads("".join(pieces))["city"], str)


def test_files_through_the_client(client: openai.OpenAI) -> None:
    """`files.create` of a batch input file, `files.retrieve`, `files.list`, `files.content`, `files.delete`."""
    line = {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}}
    content = (json.dumps(line) + "\n").encode()
    created = client.files.create(file=("requests.jsonl", content), purpose="batch")
    assert created.purpose == "batch" and created.bytes == len(content) and created.filename == "requests.jsonl"
    assert client.files.retrieve(created.id).id == created.id
    assert created.id in [f.id for f in client.files.list()]
    assert client.files.content(created.id).content == content
    assert client.files.delete(created.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)


def test_a_batch_through_the_client(client: openai.OpenAI) -> None:
    """`files.create`, `batches.create`, `batches.retrieve` until done, `files.content` of the output: every
    `custom_id` answered once; `batches.cancel` of a second batch keeps what finished."""
    import time

    def upload(n: int, max_tokens: int) -> str:
        lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Say {i}"}],
                           "max_tokens": max_tokens, "ignore_eos": True}} for i in range(n)]
        content = "".join(json.dumps(line) + "\n" for line in lines).encode()
        return client.files.create(file=("batch.jsonl", content), purpose="batch").id

    batch = client.batches.create(input_file_id=upload(4, 4), endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": "e2e"})
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.25)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 4 and batch.metadata == {"run": "e2e"}
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == ["q0", "q1", "q2", "q3"]
    assert all(o["response"]["body"]["choices"][0]["message"]["content"] is not None for o in output)
    assert batch.id in [b.id for b in client.batches.list()]

    long = client.batches.create(input_file_id=upload(40, 32), endpoint="/v1/chat/completions",
                                 completion_window="24h")
    cancelled = client.batches.cancel(long.id)
    assert cancelled.status in ("cancelling", "cancelled")
    while cancelled.status != "cancelled":
        assert time.monotonic() < deadline + 120, cancelled
        time.sleep(0.25)
        cancelled = client.batches.retrieve(long.id)
    answered = [json.loads(line)["custom_id"] for f in (cancelled.output_file_id, cancelled.error_file_id) if f
                for line in client.files.content(f).text.splitlines()]
    assert sorted(answered) == sorted(f"q{i}" for i in range(40))
