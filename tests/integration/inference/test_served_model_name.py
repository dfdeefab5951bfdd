"""Model names are names, not paths: a model loaded from a directory is served under `--served-model-name`
(the first name listed, the others accepted as aliases), and its path is not a model name."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagewise.engine.async_engine import AsyncLLMEngine
from pagewise.engine.config import EngineConfig
from pagewise.engine.errors import InvalidConfigError

from ..harness import Platform, bearer, chat_body

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def model_path(tiny_model) -> str:
    return str(tiny_model("served-names")[0])


@pytest.fixture(scope="module")
def llm_engine(model_path: str) -> Iterator[AsyncLLMEngine]:
    """A tiny model from a directory, served under two names (replaces the session's engine in this module)."""
    config = EngineConfig(model=model_path, served_model_name="tiny-chat, tiny", dtype="float32", max_model_len=256)
    engine = AsyncLLMEngine(config, progress=False)
    yield engine
    engine.shutdown()


async def test_models_lists_the_served_names_and_never_the_path(platform: Platform, model_path: str) -> None:
    _, key = await platform.tenant_with_key()
    listed = (await platform.http.get("/v1/models", headers=bearer(key))).json()["data"]
    assert [m["id"] for m in listed] == ["tiny-chat", "tiny"]
    for name in ("tiny-chat", "tiny"):
        assert (await platform.http.get(f"/v1/models/{name}", headers=bearer(key))).status_code == 200
    assert (await platform.http.get(f"/v1/models/{model_path.lstrip('/')}", headers=bearer(key))).status_code == 404


async def test_a_request_may_use_any_served_name_but_not_the_path(platform: Platform, model_path: str) -> None:
    _, key = await platform.tenant_with_key(requests_per_minute=100, tokens_per_minute=100_000)
    for name in ("tiny-chat", "tiny"):
        response = await platform.http.post(
            "/v1/chat/completions", json=chat_body(model=name, max_tokens=2), headers=bearer(key)
        )
        assert response.status_code == 200, response.text
        assert response.json()["model"] == name
    response = await platform.http.post(
        "/v1/chat/completions", json=chat_body(model=model_path, max_tokens=2), headers=bearer(key)
    )
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    assert "tiny-chat" in response.json()["error"]["message"]


@pytest.mark.parametrize("names", ["", "a b", "base:adapter", "x,x", ["ok", 3]])
def test_bad_served_names_are_refused(names) -> None:
    with pytest.raises(InvalidConfigError, match="served_model_name"):
        EngineConfig(served_model_name=names)
