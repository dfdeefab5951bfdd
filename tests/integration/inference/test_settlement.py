"""Every way a request can end settles its quota reservation exactly once and leaves its row terminal.

Paths: the client hangs up before the first chunk, the engine fails, the engine rejects the request after
admission, an abort that overtakes its Submit, an engine-side abort.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from concurrent.futures import Future
from contextlib import aclosing
from typing import Any

import pytest
from litestar.types import Message
from sqlalchemy import select

from pagewise.engine.async_engine import AsyncLLMEngine
from pagewise.engine.outputs import NO_USAGE
from pagewise.engine.request_ids import prompt_id
from pagewise.platform.db.models import ApiKey, RequestRecord
from pagewise.platform.inference.job import InferenceJob
from pagewise.platform.inference.prompts import prepare_completion
from pagewise.platform.inference.schemas import CompletionRequest
from pagewise.platform.keys.auth import Principal
from pagewise.platform.quotas.quota_store import QuotaLimits
from pagewise.serving.protocol import Submit

from ..harness import MODEL, Platform, asgi_scope, bearer

pytestmark = pytest.mark.anyio


async def _rows(platform: Platform, tenant_id: str) -> list[RequestRecord]:
    async with platform.services.sessionmaker() as session:
        query = select(RequestRecord).where(RequestRecord.tenant_id == tenant_id)
        return list((await session.scalars(query)).all())


async def _assert_settled(platform: Platform, tenant_id: str, status: str) -> RequestRecord:
    quota = await platform.services.quotas.usage(tenant_id)
    assert (quota.concurrent, quota.outstanding) == (0, 0)
    [row] = await _rows(platform, tenant_id)
    assert row.status == status, (row.status, row.error)
    assert row.finished_at is not None
    assert quota.tokens_this_minute == row.prompt_tokens + row.completion_tokens
    return row


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_disconnect_before_first_chunk_releases_the_slot(platform: Platform, path: str) -> None:
    tenant, key = await platform.tenant_with_key(max_concurrent_requests=1)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 50, "stream": True}
    if path == "/v1/completions":
        body["prompt"] = "Tell me a story."
    else:
        body["messages"] = [{"role": "user", "content": "Tell me a story."}]
    sent: list[Message] = []
    received = {"body": False}

    async def receive() -> Message:
        if not received["body"]:
            received["body"] = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        return {"type": "http.disconnect"}  # gone at once: before the stream yields anything

    async def send(message: Message) -> None:
        sent.append(message)

    await asyncio.wait_for(platform.app(asgi_scope(path, key), receive, send), timeout=120)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    row = await _assert_settled(platform, tenant["id"], "cancelled")
    # the engine may have run the prefill (and even a token) before it saw the abort: that is billed, and no more
    assert row.completion_tokens <= 1
    # the slot is free again: a second request is admitted
    again = {**body, "stream": False, "max_tokens": 1}
    response = await platform.http.post(path, json=again, headers=bearer(key))
    assert response.status_code == 200, response.text


def _failing_generate(engine: AsyncLLMEngine, *, after_first: bool) -> Any:
    """The real engine's `generate`, except that generation fails: at once, or after the first output."""
    real = engine.generate

    async def generate(
        prompt: list[int], params: Any, request_id: str, tenant_id: str, *, usage: Future, **kw: Any
    ) -> AsyncIterator[Any]:
        if after_first:  # the real engine reports the usage of the request it aborts
            async with aclosing(real(prompt, params, request_id, tenant_id, usage=usage, **kw)) as outputs:
                async for output in outputs:
                    yield output
                    break
        else:
            usage.set_result(NO_USAGE)  # nothing ran: the engine's report says so
        raise RuntimeError("engine exploded")

    return generate


@pytest.mark.parametrize("after_first", [False, True])
@pytest.mark.parametrize("stream", [False, True])
async def test_engine_failure_settles_and_fails_the_row(
    platform: Platform, monkeypatch: pytest.MonkeyPatch, after_first: bool, stream: bool
) -> None:
    tenant, key = await platform.tenant_with_key(max_concurrent_requests=1)
    engine = platform.services.engine.transport.host.engine
    monkeypatch.setattr(engine, "generate", _failing_generate(engine, after_first=after_first))
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "stream": stream}
    response = await platform.http.post("/v1/completions", json=body, headers=bearer(key))
    if stream:
        assert response.status_code == 200  # the headers went out before the failure
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert set(error) == {"message", "type", "param", "code"}
    else:
        assert response.status_code == 500
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    row = await _assert_settled(platform, tenant["id"], "failed")
    assert (row.error_code, row.error) == (
        "internal_error",
        "the engine failed while running this request",
    )  # the cause: log only


async def test_engine_validation_failure_after_reservation(platform: Platform, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation that passes at admission but fails in the engine (e.g. the engine changed in between)."""
    from pagewise.engine.errors import InvalidRequestError

    tenant, key = await platform.tenant_with_key()
    engine = platform.services.engine.transport.host.engine

    def reject(prompt: object, params: object) -> None:
        raise InvalidRequestError("rejected by the engine", param="prompt")

    monkeypatch.setattr(engine, "process_prompt", reject)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8}
    response = await platform.http.post("/v1/completions", json=body, headers=bearer(key))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == "rejected by the engine"
    assert response.json()["error"]["param"] == "prompt"
    await _assert_settled(platform, tenant["id"], "failed")


async def test_request_aborted_before_it_ran(platform: Platform, monkeypatch: pytest.MonkeyPatch) -> None:
    """An abort that reaches the engine before the Submit does: nothing runs, nothing is billed."""
    tenant, key = await platform.tenant_with_key(max_concurrent_requests=1)
    async with platform.services.sessionmaker() as session:
        key_id = await session.scalar(select(ApiKey.id).where(ApiKey.tenant_id == tenant["id"]))
    principal = Principal(
        key_id=key_id,
        tenant_id=tenant["id"],
        tenant_name=tenant["name"],
        scopes=("inference",),
        limits=QuotaLimits(max_concurrent_requests=1),
        max_tokens_per_request=None,
        max_n=None,
        weight=1.0,
    )
    prepared = await prepare_completion(
        CompletionRequest(model=MODEL, prompt="Hello", max_tokens=4), principal, platform.services.engine
    )
    host = platform.services.engine.transport.host
    real_run = host.run

    def run_after_abort(submit: Submit, emit: Any, **kw: Any) -> Any:
        host.abort(submit.request_id)  # the abort overtakes the Submit
        return real_run(submit, emit, **kw)

    monkeypatch.setattr(host, "run", run_after_abort)
    job = await InferenceJob.admit(platform.services, principal, prepared)
    await job.collect()
    assert job.final is not None and job.final.status == "cancelled"
    await asyncio.sleep(0)  # the execution's task ends right after its terminal event
    assert job.id not in host.live
    row = await _assert_settled(platform, tenant["id"], "cancelled")
    assert row.completion_tokens == 0


async def test_engine_side_abort_ends_cancelled(platform: Platform) -> None:
    """An abort from the engine's side (not the client's) ends the stream normally, the row `cancelled`."""
    tenant, key = await platform.tenant_with_key()
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True, "stream": True}
    events: list[bytes] = []
    done = asyncio.Event()

    async def receive() -> Message:
        if not events:
            events.append(b"")
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] != "http.response.body":
            return
        if not message.get("more_body"):
            done.set()
        if message.get("body", b"").startswith(b"data: {"):
            events.append(message["body"])
            if len(events) == 3:  # two text deltas in: abort on the engine's side
                request_id = json.loads(message["body"].removeprefix(b"data: "))["id"]
                platform.services.engine.transport.host.engine.abort(prompt_id(request_id, 0))

    await asyncio.wait_for(platform.app(asgi_scope("/v1/completions", key), receive, send), timeout=120)
    last = json.loads(events[-1].removeprefix(b"data: "))
    assert last["choices"][0]["finish_reason"] == "abort"
    row = await _assert_settled(platform, tenant["id"], "cancelled")
    assert 1 <= row.completion_tokens < 200
