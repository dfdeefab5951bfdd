"""A server killed (SIGKILL) in the middle of a batch loses no line and bills none twice: restarted on the same
database, it fails the requests the dead process left unfinished (billing nothing), their lines run again, and
the batch completes with every custom_id answered exactly once — each line billed by exactly one request."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from pagewise.bench.local_server import local_server
from pagewise.platform.db.models import BatchLine, RequestRecord

from ..harness import MODEL

LINES = 48
ARGS = ["--max-model-len", "512"]


def _line(i: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i}"}], "max_tokens": 24,
            "ignore_eos": True}
    return {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def _batch(base: str, key: str, batch_id: str) -> dict:
    return httpx.get(f"{base}/v1/batches/{batch_id}", headers={"Authorization": f"Bearer {key}"}).json()


def test_a_killed_server_loses_no_line_and_bills_each_once(tmp_path: Path) -> None:
    database = tmp_path / "crash.db"
    database_url = f"sqlite+aiosqlite:///{database}"
    env = {"PAGEWISE_EXPORT_DIR": str(tmp_path / "exports"), "PAGEWISE_BATCH_LINES_IN_FLIGHT": "4"}
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    with local_server(tmp_path / "first", database_url, ARGS, env=env) as server:
        admin = {"Authorization": f"Bearer {server.admin_key}"}
        tenant = httpx.post(f"{server.base}/admin/tenants", json={"name": "crash"}, headers=admin).json()
        key = httpx.post(f"{server.base}/admin/tenants/{tenant['id']}/keys", json={}, headers=admin).json()["key"]
        auth = {"Authorization": f"Bearer {key}"}
        content = "".join(json.dumps(_line(i)) + "\n" for i in range(LINES)).encode()
        file = httpx.post(
            f"{server.base}/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}, headers=auth
        ).json()
        body = {"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        batch = httpx.post(f"{server.base}/v1/batches", json=body, headers=auth).json()
        deadline = time.monotonic() + 120
        while _batch(server.base, key, batch["id"])["request_counts"]["completed"] < 3:
            assert time.monotonic() < deadline, "no line completed in 120 s"
            time.sleep(0.1)
        server.process.kill()  # SIGKILL: no drain, no shutdown, lines in flight
        server.process.wait()
    killed_at = _counts(database)
    assert killed_at["succeeded"] < LINES and killed_at["running"] > 0  # the kill caught lines in flight

    with local_server(tmp_path / "second", database_url, ARGS, env=env) as server:
        deadline = time.monotonic() + 240
        while (done := _batch(server.base, key, batch["id"]))["status"] != "completed":
            assert time.monotonic() < deadline, done
            time.sleep(0.25)
        output = httpx.get(f"{server.base}/v1/files/{done['output_file_id']}/content", headers=auth).text
    results = [json.loads(line) for line in output.splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(f"line-{i}" for i in range(LINES))
    assert all(r["response"]["status_code"] == 200 for r in results) and done["error_file_id"] is None
    assert done["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}

    engine = create_engine(f"sqlite:///{database}")
    with Session(engine) as session:
        rows = list(session.scalars(select(RequestRecord).where(RequestRecord.batch_id == batch["id"])))
    billed = [r for r in rows if r.prompt_tokens or r.completion_tokens or r.cost_micros]
    assert sorted(r.id for r in billed) == sorted(r["response"]["request_id"] for r in results)  # once per line
    lost = [r for r in rows if r.status == "failed"]
    assert lost and all(r.error_code == "worker_lost" for r in lost)  # the dead process's, billed nothing


def _counts(database: Path) -> dict[str, int]:
    engine = create_engine(f"sqlite:///{database}")
    with Session(engine) as session:
        statuses = list(session.scalars(select(BatchLine.status)))
    return {s: statuses.count(s) for s in ("pending", "running", "succeeded", "failed")}
