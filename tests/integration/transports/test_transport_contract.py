"""One suite of behaviours, run on both transports (`served`): the routes cannot tell them apart.

Streams, n > 1, stop strings, aborts, engine rejections as messages, usage, cached tokens, durable async requests.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from sqlalchemy import select

from pagewise.engine.sampling_params import SamplingParams
from pagewise.platform.db.ids import new_id
from pagewise.platform.db.models import RequestRecord, UsageDaily
from pagewise.serving.protocol import ErrorCode, Rejected, Submit

from ..harness import MODEL, Platform, bearer

pytestmark = pytest.mark.anyio
PROMPT = "The three primary colours are"


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **extra}


def _stream_text(text: str) -> tuple[dict[int, str], list[dict[str, Any]]]:
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts, chunks


async def test_stream_equals_the_whole_response_and_reports_usage(served: Platform) -> None:
    _, key = await served.tenant_with_key()
    whole = await served.http.post("/v1/completions", json=_body(), headers=bearer(key))
    assert whole.status_code == 200, whole.text
    streamed = await served.http.post(
        "/v1/completions", json=_body(stream=True, stream_options={"include_usage": True}), headers=bearer(key)
    )
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    texts, chunks = _stream_text(streamed.text)
    assert texts == {0: whole.json()["choices"][0]["text"]}
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == whole.json()["usage"]["completion_tokens"] == 12
    assert usage["prompt_tokens"] == whole.json()["usage"]["prompt_tokens"]


async def test_the_queue_hop_is_measured_once_per_admitted_request(served: Platform) -> None:
    """The API observes hand-over -> first token minus the engine side's own time to it, once per request it
    admitted: a small positive figure, well under the request's whole time to first token."""
    _, key = await served.tenant_with_key()
    hop = served.services.metrics.queue_hop
    before = _histogram(hop)
    for stream in (False, True):
        response = await served.http.post("/v1/completions", json=_body(stream=stream), headers=bearer(key))
        assert response.status_code == 200, response.text
    count, total = (a - b for a, b in zip(_histogram(hop), before, strict=True))
    assert count == 2
    assert 0 <= total / count < 1.0


def _histogram(histogram) -> tuple[float, float]:  # noqa: ANN001 - a prometheus_client Histogram
    samples = {s.name: s.value for metric in histogram.collect() for s in metric.samples}
    return samples["pagewise_api_queue_hop_seconds_count"], samples["pagewise_api_queue_hop_seconds_sum"]


async def test_n_seeded_samples_are_reproducible(served: Platform) -> None:
    _, key = await served.tenant_with_key()
    body = _body(n=3, temperature=1.0, seed=7)
    first, second = [await served.http.post("/v1/completions", json=body, headers=bearer(key)) for _ in range(2)]
    assert first.status_code == 200, first.text
    texts = [c["text"] for c in first.json()["choices"]]
    assert [c["index"] for c in first.json()["choices"]] == [0, 1, 2]
    assert texts == [c["text"] for c in second.json()["choices"]]
    reasons = [c["finish_reason"] for c in first.json()["choices"]]
    assert set(reasons) <= {"stop", "length"}
    generated = first.json()["usage"]["completion_tokens"]
    assert generated == 3 * 12 if reasons == ["length"] * 3 else generated < 3 * 12


async def test_stop_string_ends_the_text_before_it(served: Platform) -> None:
    _, key = await served.tenant_with_key()
    free = (await served.http.post("/v1/completions", json=_body(), headers=bearer(key))).json()
    word = free["choices"][0]["text"].split()[1]
    stopped = (await served.http.post("/v1/completions", json=_body(stop=[word]), headers=bearer(key))).json()
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and word not in choice["text"]
    assert free["choices"][0]["text"].startswith(choice["text"])


async def test_cached_tokens_and_usage_rows(served: Platform) -> None:
    tenant, key = await served.tenant_with_key()
    long_prompt = "Paged attention stores the KV cache in fixed-size blocks. " * 6
    body = _body(prompt=long_prompt, max_tokens=4)
    first = (await served.http.post("/v1/completions", json=body, headers=bearer(key))).json()
    second = (await served.http.post("/v1/completions", json=body, headers=bearer(key))).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    async with served.services.sessionmaker() as session:
        rows = (await session.scalars(select(RequestRecord).where(RequestRecord.tenant_id == tenant["id"]))).all()
        daily = (await session.scalars(select(UsageDaily).where(UsageDaily.tenant_id == tenant["id"]))).all()
    assert sorted(r.cached_tokens for r in rows) == [0, second["usage"]["prompt_tokens_details"]["cached_tokens"]]
    assert all(r.status == "completed" for r in rows)
    assert sum(d.requests for d in daily) == 2
    assert sum(d.completion_tokens for d in daily) == 8
    assert sum(d.prompt_tokens for d in daily) == first["usage"]["prompt_tokens"] * 2
    quota = await served.services.quotas.usage(tenant["id"])
    assert quota.concurrent == 0 and quota.tokens_this_month == first["usage"]["total_tokens"] * 2  # real clock


async def test_async_request_runs_without_a_reader_and_cancels(served: Platform) -> None:
    tenant, key = await served.tenant_with_key()
    short = {"endpoint": "/v1/completions", **_body(max_tokens=3)}
    done = (await served.http.post("/v1/requests", json=short, headers=bearer(key))).json()
    for _ in range(300):
        row = (await served.http.get(f"/v1/requests/{done['id']}", headers=bearer(key))).json()
        if row["status"] == "completed":
            break
        await asyncio.sleep(0.1)
    assert row["status"] == "completed" and row["usage"]["completion_tokens"] == 3
    long = {"endpoint": "/v1/completions", **_body(max_tokens=400, ignore_eos=True)}
    submitted = (await served.http.post("/v1/requests", json=long, headers=bearer(key))).json()
    await asyncio.sleep(0.3)
    cancelled = await served.http.delete(f"/v1/requests/{submitted['id']}", headers=bearer(key))
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["usage"]["completion_tokens"] < 400
    quota = await served.services.quotas.usage(tenant["id"])
    assert quota.concurrent == 0


async def test_an_engine_rejection_crosses_as_a_message(served: Platform) -> None:
    """A Submit the engine refuses (a token id outside the vocabulary) ends with `Rejected`, not an exception."""
    tenant, _ = await served.tenant_with_key()
    transport = served.services.engine.transport
    reservation = (await served.services.quotas.reserve(tenant["id"], _no_limits(), 10, "r")).reservation
    submit = Submit(
        request_id=new_id("cmpl"), tenant_id=tenant["id"], model=MODEL, endpoint="completions",
        prompts=[[10**7]], params=SamplingParams(max_tokens=2), reservation=reservation,
    )
    await transport.submit(submit)
    events = [event async for event in transport.events(submit.request_id)]
    assert isinstance(events[-1], Rejected) and events[-1].error.code is ErrorCode.INVALID_REQUEST
    assert "vocabulary" in events[-1].error.message or "token ids" in events[-1].error.message


def _no_limits():  # noqa: ANN202
    from pagewise.platform.quotas.quota_store import QuotaLimits

    return QuotaLimits()
