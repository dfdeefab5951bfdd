"""The distributed stack as real processes, on PostgreSQL and Redis: a 200-line batch, one `pagewise worker`
SIGKILLed mid-way and the API replica that runs the batch (its runner) SIGKILLed and replaced. Every line is
answered exactly once, the usage rows count exactly the requests that ran, and the cost is exact: each line billed
by one request, at the batch rate."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import Session

from pagewise.bench.local_server import local_server
from pagewise.bench.stack import distributed_stack
from pagewise.platform.db.migrate import upgrade_head
from pagewise.platform.db.models import RequestRecord, UsageDaily

from ..conftest import REDIS_URL

LINES = 200
PRICE = {"input": 2, "output": 8}  # dollars per million tokens; a batch line pays 50% of it


def _line(i: int, model: str) -> dict:
    body = {"model": model, "prompt": f"Line {i}: count", "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    return {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": body}


def _sync_url(database_url: str) -> str:
    return database_url.replace("postgresql+asyncpg://", "postgresql+psycopg://")


def test_a_killed_worker_and_a_killed_api_replica_lose_no_line_and_bill_each_once(
    tmp_path: Path, tiny_model: Callable, fresh_database: Callable[[str], str]
) -> None:
    model, _ = tiny_model("batch-crash-distributed")
    database_url = fresh_database("postgres")
    upgrade_head(database_url)
    env = {
        "PAGEWISE_WORKER_HEARTBEAT_S": "0.5",
        "PAGEWISE_QUOTA_LEASE_S": "30",
        "PAGEWISE_EXPORT_DIR": str(tmp_path / "exports"),  # the files every replica reads
        "PAGEWISE_BATCH_LINES_IN_FLIGHT": "16",
    }
    engine_args = ["--model", str(model), "--max-model-len", "256", "--dtype", "float32"]
    with distributed_stack(tmp_path, database_url, engine_args, workers=2, redis_url=REDIS_URL, env=env) as stack:
        api = stack.api
        admin = {"Authorization": f"Bearer {api.admin_key}"}
        tenant = httpx.post(f"{api.base}/admin/tenants", json={"name": "crash"}, headers=admin).json()
        key = httpx.post(f"{api.base}/admin/tenants/{tenant['id']}/keys", json={}, headers=admin).json()["key"]
        auth = {"Authorization": f"Bearer {key}"}
        price = httpx.post(f"{api.base}/admin/prices", json={"model": str(model), **PRICE}, headers=admin)
        assert price.status_code == 201, price.text
        content = "".join(json.dumps(_line(i, str(model))) + "\n" for i in range(LINES)).encode()
        file = httpx.post(
            f"{api.base}/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}, headers=auth
        ).json()
        body = {"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
        batch = httpx.post(f"{api.base}/v1/batches", json=body, headers=auth).json()

        def counts(base: str) -> dict:
            return httpx.get(f"{base}/v1/batches/{batch['id']}", headers=auth, timeout=30).json()["request_counts"]

        deadline = time.monotonic() + 180
        while counts(api.base)["completed"] < 30:
            assert time.monotonic() < deadline, "no 30 lines completed in 180 s"
            time.sleep(0.1)
        stack.workers["w0"].send_signal(signal.SIGKILL)  # lines in flight on it: redelivered to w1
        time.sleep(1.0)
        api.process.send_signal(signal.SIGKILL)  # the runner's process: claimed lines, unsettled lines
        api.process.wait()
        killed_at = counts_from_database(database_url, batch["id"])
        assert killed_at["done"] < LINES
        (tmp_path / "replica").mkdir()
        with local_server(tmp_path / "replica", database_url, ["--workers-external"], env=stack.api_env) as replica:
            deadline = time.monotonic() + 300
            while (done := httpx.get(f"{replica.base}/v1/batches/{batch['id']}", headers=auth).json())[
                "status"
            ] != "completed":
                assert time.monotonic() < deadline, done
                time.sleep(0.25)
            output = httpx.get(f"{replica.base}/v1/files/{done['output_file_id']}/content", headers=auth).text

    results = [json.loads(line) for line in output.splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(f"line-{i}" for i in range(LINES))
    assert all(r["response"]["status_code"] == 200 for r in results) and done["error_file_id"] is None
    assert done["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 6 for r in results)

    engine = create_engine(_sync_url(database_url))
    with Session(engine) as session:
        rows = list(session.scalars(select(RequestRecord).where(RequestRecord.batch_id == batch["id"])))
        usage = session.execute(
            select(func.sum(UsageDaily.requests), func.sum(UsageDaily.cost_micros),
                   func.sum(UsageDaily.completion_tokens)).where(UsageDaily.batch_id == batch["id"])
        ).one()
    engine.dispose()
    billed = [r for r in rows if r.status == "completed"]
    assert sorted(r.id for r in billed) == sorted(r["response"]["request_id"] for r in results)  # once per line
    assert all(r.status in ("completed", "failed") for r in rows)
    assert all(r.error_code == "worker_lost" and r.completion_tokens == 0 for r in rows if r.status == "failed")
    expected_cost = sum(
        (r.prompt_tokens * PRICE["input"] + r.completion_tokens * PRICE["output"]) // 2 for r in billed
    )  # micro-dollars: dollars per million tokens x tokens / 10^6 x 10^6, at 50%
    assert usage == (LINES, expected_cost, LINES * 6)
    assert sum(r.cost_micros for r in rows) == expected_cost


def counts_from_database(database_url: str, batch_id: str) -> dict[str, int]:
    engine = create_engine(_sync_url(database_url))
    with Session(engine) as session:
        done = session.scalar(
            select(func.count()).select_from(RequestRecord).where(
                RequestRecord.batch_id == batch_id, RequestRecord.status == "completed"
            )
        )
    engine.dispose()
    return {"done": done or 0}
