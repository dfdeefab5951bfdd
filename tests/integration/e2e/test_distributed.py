"""The distributed stack as separate processes: one API replica (no model) and two `pagewise worker`s, on the
machine's PostgreSQL and Redis, with a tiny random model. 200 requests from 3 tenants — streamed and not, some
cancelled — while one worker is SIGKILLed mid-flight. Then:

- every request ends exactly once, in a terminal state, and none is lost;
- every completed greedy output equals a single in-process engine's output for the same prompt;
- the usage rows equal the sum of the requests' tokens; no quota slot stays held; the surviving worker's KV
  blocks are all free again;
- no prefix-cache hit crosses tenants: a prompt each tenant sent once never reports cached tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from pagewise.bench.local_server import local_server
from pagewise.bench.stack import distributed_stack
from pagewise.platform.db.migrate import upgrade_head
from pagewise.platform.db.models import UNFINISHED_STATUSES, RequestRecord, UsageDaily
from pagewise.platform.db.session import create_db_engine, create_sessionmaker
from pagewise.platform.quotas.redis_store import RedisQuotaStore

from ..conftest import REDIS_URL
from ..harness import bearer

pytestmark = pytest.mark.anyio
NUM_REQUESTS = 200
MAX_MODEL_LEN = 512
HEARTBEAT_S = 0.5
SHARED = [f"Shared prompt {i}: the quick brown fox jumps over the lazy dog near the river bank today" for i in range(4)]
OWN = "Repeated prompt of one tenant: paged attention keeps the KV cache in blocks of sixteen tokens each"


@pytest.fixture
def stack(tmp_path: Path, tiny_model: Callable, fresh_database: Callable[[str], str]) -> Iterator[dict[str, Any]]:
    model, _ = tiny_model("distributed")
    database_url = fresh_database("postgres")
    upgrade_head(database_url)
    env = {"PAGEWISE_WORKER_HEARTBEAT_S": str(HEARTBEAT_S), "PAGEWISE_QUOTA_LEASE_S": "30"}
    # fp32, the exact path: the texts are compared with an in-process engine's
    engine_args = ["--model", str(model), "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32"]
    with distributed_stack(tmp_path, database_url, engine_args, workers=2, redis_url=REDIS_URL, env=env) as running:
        yield {"api": running.api, "workers": running.workers, "model": model, "database_url": database_url,
               "prefix": running.key_prefix, "logs": tmp_path, "api_env": running.api_env}


async def _tenant(http: httpx.AsyncClient, admin: str, name: str) -> tuple[str, str]:
    body = {"name": name, "requests_per_minute": None, "max_concurrent_requests": 64}
    tenant = (await http.post("/admin/tenants", json=body, headers=bearer(admin))).json()
    key = (await http.post(f"/admin/tenants/{tenant['id']}/keys", json={}, headers=bearer(admin))).json()["key"]
    return tenant["id"], key


def _plan(keys: list[str]) -> list[dict[str, Any]]:
    """200 requests: each tenant sends each shared prompt once (a hit there would cross tenants), its own
    prompt many times; a third stream, one in ten is cancelled."""
    rng = random.Random(0)
    plan = []
    for t, key in enumerate(keys):
        for prompt in SHARED:
            plan.append({"key": key, "tenant": t, "prompt": prompt, "once": True})
    while len(plan) < NUM_REQUESTS:
        t = rng.randrange(len(keys))
        plan.append({"key": keys[t], "tenant": t, "prompt": f"{OWN} (tenant {t})", "once": False})
    rng.shuffle(plan)
    for i, item in enumerate(plan):
        item["max_tokens"] = 4 + i % 13
        item["mode"] = "cancel" if i % 10 == 3 else "stream" if i % 3 == 0 else "plain"
    return plan


async def _send(http: httpx.AsyncClient, item: dict[str, Any]) -> dict[str, Any]:
    body = {"model": item["model"], "prompt": item["prompt"], "max_tokens": item["max_tokens"], "temperature": 0}
    headers = bearer(item["key"])
    if item["mode"] == "cancel":
        long = {**body, "endpoint": "/v1/completions", "max_tokens": 300, "ignore_eos": True}
        submitted = await http.post("/v1/requests", json=long, headers=headers)
        assert submitted.status_code == 202, submitted.text
        await asyncio.sleep(0.05)
        cancelled = await http.delete(f"/v1/requests/{submitted.json()['id']}", headers=headers)
        return {"id": submitted.json()["id"], "status": cancelled.json()["status"]}
    if item["mode"] == "stream":
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=headers) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
        chunks = [json.loads(line[6:]) for line in lines]
        assert all("error" not in c for c in chunks), chunks[-1]
        return {"id": chunks[0]["id"], "text": "".join(c["choices"][0]["text"] for c in chunks if c["choices"])}
    response = await http.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return {"id": response.json()["id"], "text": response.json()["choices"][0]["text"]}


async def _workers(http: httpx.AsyncClient, admin: str) -> dict[str, dict[str, Any]]:
    listed = (await http.get("/admin/workers", headers=bearer(admin))).json()["data"]
    return {w["worker_id"]: w for w in listed}


async def test_two_workers_one_killed_mid_flight(stack: dict[str, Any]) -> None:
    api, workers = stack["api"], stack["workers"]
    async with httpx.AsyncClient(base_url=api.base, timeout=120) as http:
        deadline = time.monotonic() + 120
        while len(await _workers(http, api.admin_key)) < 2:  # both workers announced
            assert time.monotonic() < deadline, "the workers did not come up"
            await asyncio.sleep(0.25)
        tenants = [await _tenant(http, api.admin_key, f"dist-{i}") for i in range(3)]
        plan = _plan([key for _, key in tenants])
        for item in plan:
            item["model"] = str(stack["model"])
        results: list[dict[str, Any] | None] = [None] * len(plan)
        limit = asyncio.Semaphore(24)
        done = 0

        async def one(i: int) -> None:
            nonlocal done
            async with limit:
                results[i] = await _send(http, plan[i])
                done += 1

        tasks = [asyncio.create_task(one(i)) for i in range(len(plan))]
        victim = None
        while victim is None:  # kill a worker while it is generating
            await asyncio.sleep(0.05)
            busy = [w for w, state in (await _workers(http, api.admin_key)).items() if state["running"] > 0]
            if busy and done >= 30:
                victim = busy[0]
        workers[victim].send_signal(signal.SIGKILL)
        await asyncio.gather(*tasks)
        survivor = next(w for w in workers if w != victim)
        await asyncio.sleep(3 * HEARTBEAT_S)
        state = (await _workers(http, api.admin_key))[survivor]

    # every request ended exactly once, in a terminal state
    db = create_db_engine(stack["database_url"])
    async with create_sessionmaker(db)() as session:
        rows = {r.id: r for r in (await session.scalars(select(RequestRecord))).all()}
        daily = (await session.scalars(select(UsageDaily))).all()
    await db.dispose()
    assert len(rows) == NUM_REQUESTS and all(r["id"] in rows for r in results)
    assert not [r for r in rows.values() if r.status in UNFINISHED_STATUSES]
    for item, result in zip(plan, results, strict=True):
        expected = "cancelled" if item["mode"] == "cancel" else "completed"
        row = rows[result["id"]]
        assert row.status in (expected, "completed"), (row.status, row.error)

    # greedy outputs equal a single engine's
    from pagewise.engine.llm import LLM
    from pagewise.engine.sampling_params import SamplingParams

    llm = LLM(str(stack["model"]), max_model_len=MAX_MODEL_LEN, progress=False, dtype="float32")
    keyed = sorted({(i["prompt"], i["max_tokens"]) for i in plan if i["mode"] != "cancel"})
    outputs = [
        llm.generate([p], SamplingParams(max_tokens=m, temperature=0), use_tqdm=False)[0].outputs[0].text
        for p, m in keyed
    ]
    reference = dict(zip(keyed, outputs, strict=True))
    for item, result in zip(plan, results, strict=True):
        if item["mode"] != "cancel":
            assert result["text"] == reference[(item["prompt"], item["max_tokens"])], item
            assert rows[result["id"]].output[0]["text"] == result["text"]

    # usage rows = the requests' tokens; no quota slot held; the survivor's KV cache is free again
    by_tenant = {tid: [r for r in rows.values() if r.tenant_id == tid] for tid, _ in tenants}
    for tid, tenant_rows in by_tenant.items():
        usage = [d for d in daily if d.tenant_id == tid]
        assert sum(d.requests for d in usage) == len(tenant_rows)
        assert sum(d.prompt_tokens for d in usage) == sum(r.prompt_tokens for r in tenant_rows)
        assert sum(d.completion_tokens for d in usage) == sum(r.completion_tokens for r in tenant_rows)
    quotas = RedisQuotaStore.from_url(REDIS_URL, stack["prefix"])
    for tid, _ in tenants:
        assert (await quotas.usage(tid)).concurrent == 0
    await quotas.close()
    assert state["running"] == 0 and state["waiting"] == 0 and state["kv_usage"] == 0.0
    survivor_log = (stack["logs"] / f"worker-{survivor}.log").read_text()
    assert f"worker {victim} is gone" in survivor_log  # it adopted the dead worker's inbox

    # no cross-tenant prefix hit: a prompt a tenant sent once was never served from cache
    once = [rows[r["id"]] for item, r in zip(plan, results, strict=True) if item["once"]]
    assert once and all(r.cached_tokens == 0 for r in once), [(r.id, r.cached_tokens) for r in once]
    repeated = [rows[r["id"]] for item, r in zip(plan, results, strict=True) if not item["once"]]
    assert any(r.cached_tokens > 0 for r in repeated)  # the cache does work within a tenant


async def test_async_requests_outlive_their_api_replica(stack: dict[str, Any], tmp_path: Path) -> None:
    """A request accepted by a replica that is then SIGKILLed is run by a worker and read from another replica."""
    api = stack["api"]
    async with httpx.AsyncClient(base_url=api.base, timeout=60) as http:
        _, key = await _tenant(http, api.admin_key, "durable")
        body = {"endpoint": "/v1/completions", "model": str(stack["model"]), "prompt": "Durable:", "max_tokens": 64,
                "temperature": 0, "ignore_eos": True}
        submitted = await http.post("/v1/requests", json=body, headers=bearer(key))
        assert submitted.status_code == 202, submitted.text
    api.process.send_signal(signal.SIGKILL)
    replica_dir = tmp_path / "replica"
    replica_dir.mkdir()
    with local_server(replica_dir, stack["database_url"], ["--workers-external"], env=stack["api_env"]) as replica:
        async with httpx.AsyncClient(base_url=replica.base, timeout=60) as http:
            for _ in range(600):
                row = (await http.get(f"/v1/requests/{submitted.json()['id']}", headers=bearer(key))).json()
                if row["status"] not in ("queued", "running"):
                    break
                await asyncio.sleep(0.1)
    assert row["status"] == "completed" and row["usage"]["completion_tokens"] == 64
