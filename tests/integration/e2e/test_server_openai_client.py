"""The real server process (`python -m pagewise.platform serve`) driven by the official `openai` client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pagewise.platform.keys.key_format import generate_key

MODEL = "smollm2-135m-instruct"
STARTUP_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(base URL, admin key): the first start on an empty database stores the key given in PAGEWISE_ADMIN_KEY."""
    port = _free_port()
    admin_key = generate_key().key
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    env = {
        **os.environ,
        "PAGEWISE_DATABASE_URL": f"sqlite+aiosqlite:///{log_path.parent / 'e2e.db'}",
        "PAGEWISE_ADMIN_KEY": admin_key,
    }
    env.pop("PAGEWISE_REDIS_URL", None)
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagewise.platform",
                "serve",
                "--port",
                str(port),
                "--max-model-len",
                "512",
                "--log-level",
                "warning",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=Path(__file__).resolve().parents[3],
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert process.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"{base}/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"server did not become ready:\n{log_path.read_text()}")
        yield base, admin_key
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert admin_key.split("_", 2)[2] not in log_path.read_text()  # the secret never reaches the output


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
