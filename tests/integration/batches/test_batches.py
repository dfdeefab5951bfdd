"""The Batch API on the real model: a batch's lines run in the background through the same admission, rows and
engine as interactive requests, at the `batch` priority class, outside the interactive rate limits, each priced at
the batch rate and answered exactly once (in the output file, or the error file); cancelling keeps what finished;
a file another tenant owns, a deleted file, or a line its endpoint would refuse is a 400 that stores nothing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.db.models import Batch, RequestRecord
from pagewise.serving.money import micros_for

from ..billing.prices import ensure_price, micros
from ..harness import Platform, bearer
from .test_files import batch_line, jsonl, upload

pytestmark = pytest.mark.anyio
DONE = ("completed", "cancelled", "expired")


@pytest.fixture
def platform_settings(tmp_path: Path) -> dict:
    return {"export_dir": str(tmp_path / "exports"), "batch_lines_in_flight": 4}  # a cancel finds lines pending


async def create_batch(platform: Platform, key: str, lines: list, **extra):
    file = (await upload(platform, key, jsonl(lines))).json()
    body = {"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h", **extra}
    return await platform.http.post("/v1/batches", json=body, headers=bearer(key))


async def wait_done(platform: Platform, key: str, batch_id: str, timeout: float = 120) -> dict:
    async with asyncio.timeout(timeout):
        while True:
            batch = (await platform.http.get(f"/v1/batches/{batch_id}", headers=bearer(key))).json()
            if batch["status"] in DONE:
                return batch
            await asyncio.sleep(0.2)


async def file_lines(platform: Platform, key: str, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    content = await platform.http.get(f"/v1/files/{file_id}/content", headers=bearer(key))
    assert content.status_code == 200
    return [json.loads(line) for line in content.text.splitlines()]


async def test_a_batch_runs_every_line_once_at_the_batch_rate(platform: Platform, session: AsyncSession) -> None:
    price = await ensure_price(platform)
    tenant, key = await platform.tenant_with_key(requests_per_minute=1)  # the batch must not count against it
    lines = [batch_line(f"q{i}", f"Count to {i}") for i in range(5)]
    created = await create_batch(platform, key, lines, metadata={"job": "nightly"})
    assert created.status_code == 200, created.text
    batch = created.json()
    assert (batch["object"], batch["status"], batch["metadata"]) == ("batch", "in_progress", {"job": "nightly"})
    assert batch["request_counts"] == {"total": 5, "completed": 0, "failed": 0}

    done = await wait_done(platform, key, batch["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert done["error_file_id"] is None and done["completed_at"] >= done["created_at"]
    output = await file_lines(platform, key, done["output_file_id"])
    assert sorted(o["custom_id"] for o in output) == [f"q{i}" for i in range(5)]
    for result in output:
        response = result["response"]
        assert response["status_code"] == 200 and result["error"] is None
        body = response["body"]
        assert body["object"] == "chat.completion" and body["id"] == response["request_id"]
        assert body["choices"][0]["message"]["role"] == "assistant" and body["usage"]["completion_tokens"] > 0

    rows = list(await session.scalars(select(RequestRecord).where(RequestRecord.batch_id == batch["id"])))
    assert sorted(r.id for r in rows) == sorted(o["response"]["request_id"] for o in output)
    for row in rows:  # billed at the batch rate
        full = (
            (row.prompt_tokens - row.cached_tokens) * micros(price, "input")
            + row.cached_tokens * micros(price, "cached_input")
            + row.completion_tokens * micros(price, "output")
        )
        assert row.cost_micros == micros_for(full * price["batch_percent"] // 100) > 0
    for width in ("1d", "1h"):  # usage and cost grouped by batch: the batch's alone, as billed
        page = await platform.http.get(
            "/v1/usage", params={"group_by": "batch_id", "bucket_width": width}, headers=bearer(key)
        )
        results = [r for bucket in page.json()["data"] for r in bucket["results"] if r["batch_id"] == batch["id"]]
        assert sum(r["num_model_requests"] for r in results) == 5
        assert sum(r["cost_micros"] for r in results) == sum(row.cost_micros for row in rows)
    # the interactive rate limit of 1 request a minute is still unused
    interactive = await platform.http.post("/v1/chat/completions", json=lines[0]["body"], headers=bearer(key))
    assert interactive.status_code == 200, interactive.text
    listed = (await platform.http.get("/v1/batches", headers=bearer(key))).json()
    assert [b["id"] for b in listed["data"]] == [batch["id"]]


async def test_batch_lines_run_at_the_batch_priority_class(platform: Platform, engine_priorities) -> None:
    _, key = await platform.tenant_with_key()
    batch = (await create_batch(platform, key, [batch_line("a"), batch_line("b", priority=-3)])).json()
    await wait_done(platform, key, batch["id"])
    assert engine_priorities == [1, 1]


async def test_cancel_keeps_what_finished_and_answers_every_line_once(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    lines = [batch_line(f"c{i}", max_tokens=24, ignore_eos=True) for i in range(30)]
    batch = (await create_batch(platform, key, lines)).json()
    await asyncio.sleep(1.0)
    cancelled = await platform.http.post(f"/v1/batches/{batch['id']}/cancel", headers=bearer(key))
    assert cancelled.status_code == 200 and cancelled.json()["status"] in ("cancelling", "cancelled")
    done = await wait_done(platform, key, batch["id"])
    assert done["status"] == "cancelled" and done["cancelled_at"] is not None
    output = await file_lines(platform, key, done["output_file_id"])
    errors = await file_lines(platform, key, done["error_file_id"])
    assert sorted(r["custom_id"] for r in output + errors) == sorted(f"c{i}" for i in range(30))
    assert errors and all(e["error"]["code"] == "batch_cancelled" and e["response"] is None for e in errors)
    assert done["request_counts"] == {"total": 30, "completed": len(output), "failed": 0}
    again = await platform.http.post(f"/v1/batches/{batch['id']}/cancel", headers=bearer(key))
    assert again.status_code == 200 and again.json()["status"] == "cancelled"


async def test_another_tenants_batch_is_a_404(platform: Platform) -> None:
    _, owner = await platform.tenant_with_key()
    _, other = await platform.tenant_with_key()
    batch = (await create_batch(platform, owner, [batch_line("a")])).json()
    for method, path in (("GET", ""), ("POST", "/cancel")):
        response = await platform.http.request(method, f"/v1/batches/{batch['id']}{path}", headers=bearer(other))
        assert response.status_code == 404
    assert (await platform.http.get("/v1/batches", headers=bearer(other))).json()["data"] == []
    await wait_done(platform, owner, batch["id"])


@pytest.mark.parametrize(
    ("lines", "extra", "message"),
    [
        ([batch_line("a"), {**batch_line("b"), "url": "/v1/completions"}], {}, "line 2: url '/v1/completions'"),
        ([batch_line("a", max_tokens=0)], {}, "line 1 (max_tokens)"),
        ([batch_line("a", stream=True)], {}, "line 1 (stream): stream is not supported in a batch"),
        ([batch_line("a", temprature=1)], {}, "line 1 (temprature)"),
        ([batch_line("a")], {"completion_window": "1h"}, "completion_window"),
        ([batch_line("a")], {"endpoint": "/v1/embeddings"}, "endpoint"),
    ],
)
async def test_a_batch_its_endpoint_would_refuse_is_a_400(
    platform: Platform, session: AsyncSession, lines: list, extra: dict, message: str
) -> None:
    tenant, key = await platform.tenant_with_key()
    response = await create_batch(platform, key, lines, **extra)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert await session.scalar(select(func.count()).select_from(Batch).where(Batch.tenant_id == tenant["id"])) == 0


async def test_another_tenants_or_a_deleted_file_is_refused(platform: Platform, session: AsyncSession) -> None:
    _, owner = await platform.tenant_with_key()
    tenant, other = await platform.tenant_with_key()
    file = (await upload(platform, owner, jsonl([batch_line("a")]))).json()
    body = {"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    foreign = await platform.http.post("/v1/batches", json=body, headers=bearer(other))
    assert foreign.status_code == 400 and "No file found" in foreign.json()["error"]["message"]
    assert (await platform.http.delete(f"/v1/files/{file['id']}", headers=bearer(owner))).status_code == 200
    deleted = await platform.http.post("/v1/batches", json=body, headers=bearer(owner))
    assert deleted.status_code == 400 and "has been deleted" in deleted.json()["error"]["message"]
    assert deleted.json()["error"]["param"] == "input_file_id"
    assert await session.scalar(select(func.count()).select_from(Batch).where(Batch.tenant_id == tenant["id"])) == 0
