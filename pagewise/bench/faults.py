"""``pagewise bench faults``: the distributed stack under steady load while its parts fail, and the books after.

Real processes on this machine: two `pagewise worker`s, two API replicas (`pagewise serve --workers-external`)
and a `pagewise jobs worker`, on a fresh PostgreSQL database and a Redis server of the bench's own
(`redis-server` on a free port, nothing persisted). Three tenants send streamed chat requests and asynchronous
ones (`POST /v1/requests`) to both replicas without pause; one tenant has a monthly token budget. Meanwhile,
one after the other:

1. `redis`: Redis is killed and started again, empty (what a restart without persistence does);
2. `postgres`: every connection to PostgreSQL is cut and new ones are refused for a few seconds (the database's
   connections go through a `CuttableProxy`: what clients see while it restarts);
3. `worker_stall`: a worker is stopped (SIGSTOP) past its lease, then resumed;
4. `worker_kill`: the other worker is killed (SIGKILL) and a new one started;
5. `api_kill`: the second API replica is killed (SIGKILL); its clients go to the first.

After each fault a probe tenant's request is sent every 0.25 s until one succeeds: `recovery_s`. When the load
stops, the bench waits for every admitted request to end, then reads the database: every admitted request must
have ended exactly once (`lost`: admitted ids whose row is missing or unfinished), the usage rows must equal the
requests' rows (`double_billed`: tokens in `usage_daily` beyond the rows' sum, per tenant), the budget must hold
(`budget_exceeded`), no answer may be a 5xx other than 503, and the jobs worker, alive through it all, must
export each tenant's month with the cost its usage rows hold (`exports_matching_usage`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pagewise.bench._common import progress as log
from pagewise.bench.fault_proxy import BackgroundProxy
from pagewise.bench.local_server import LocalServer, free_port, local_server, stop_process_group
from pagewise.bench.stack import Stack, distributed_stack, start_worker
from pagewise.exit_status import ExitStatus

TENANTS = 3
BUDGET_TOKENS = 2_000  # the budgeted tenant's monthly tokens: spent during the run, so refusals happen too
MAX_TOKENS = 12
LOOPS_PER_TENANT = 2
STALL_S = 7.0  # past the workers' lease (five 1 s heartbeats)
POSTGRES_DOWN_S = 3.0
SETTLE_TIMEOUT_S = 240.0


@dataclass(slots=True)
class Outcome:
    tenant: int
    kind: str  # "stream" or "async"
    status: int | str  # the HTTP status, or "connection_error"
    request_id: str | None  # set for an admitted request
    code: str | None = None  # a refusal's error code


def _code(body: bytes) -> str | None:
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


@dataclass(slots=True)
class Load:
    """The steady load: each tenant's loops send requests until `stop`; every outcome is kept."""

    bases: list[str]
    keys: list[str]
    model: str
    outcomes: list[Outcome] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    dead_bases: set[str] = field(default_factory=set)

    async def run(self) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(
                *(self._loop(client, t, i) for t in range(len(self.keys)) for i in range(LOOPS_PER_TENANT))
            )

    async def _loop(self, client: Any, tenant: int, index: int) -> None:
        import httpx

        n = index
        while not self.stop.is_set():
            n += 1
            live = [b for b in self.bases if b not in self.dead_bases]
            base = live[n % len(live)]
            kind = "stream" if n % 2 else "async"
            try:
                outcome = await (self._stream if kind == "stream" else self._async)(client, base, tenant, n)
            except (httpx.TransportError, httpx.StreamError):  # a replica killed under us
                outcome = Outcome(tenant, kind, "connection_error", None)
            self.outcomes.append(outcome)
            if outcome.status not in (200, 202):
                await asyncio.sleep(0.2)

    def _body(self, tenant: int, n: int) -> dict[str, Any]:
        content = f"Tenant {tenant} request {n}: say something short."
        return {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
                "temperature": 0}

    async def _stream(self, client: Any, base: str, tenant: int, n: int) -> Outcome:
        headers = {"Authorization": f"Bearer {self.keys[tenant]}"}
        body = {**self._body(tenant, n), "stream": True}
        request_id = None
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                return Outcome(tenant, "stream", response.status_code, None, _code(await response.aread()))
            async for line in response.aiter_lines():
                if line.startswith("data: {") and request_id is None:
                    request_id = json.loads(line[6:]).get("id")
        return Outcome(tenant, "stream", 200, request_id)

    async def _async(self, client: Any, base: str, tenant: int, n: int) -> Outcome:
        headers = {"Authorization": f"Bearer {self.keys[tenant]}"}
        body = {**self._body(tenant, n), "endpoint": "/v1/chat/completions"}
        response = await client.post(f"{base}/v1/requests", json=body, headers=headers)
        if response.status_code != 202:
            return Outcome(tenant, "async", response.status_code, None, _code(response.content))
        return Outcome(tenant, "async", 202, response.json()["id"])


@contextmanager
def private_redis(workdir: Path):
    """A `redis-server` of the bench's own on a free port, persisting nothing; yields a restart function."""
    port = free_port()
    argv = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1"]
    log_path = workdir / "redis.log"
    state: dict[str, subprocess.Popen] = {}

    def start() -> None:
        with log_path.open("a") as out:
            state["process"] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        _wait_port(port)

    def restart() -> None:
        state["process"].kill()
        state["process"].wait()
        time.sleep(1.0)
        start()

    start()
    try:
        yield f"redis://127.0.0.1:{port}/0", restart
    finally:
        state["process"].kill()
        state["process"].wait()


def _wait_port(port: int, timeout_s: float = 20.0) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout_s:g} s")


@contextmanager
def fresh_postgres(admin_dsn: str):
    """A new PostgreSQL database (migrated) for the run, dropped afterwards; yields its async URL."""
    import psycopg

    from pagewise.platform.db.migrate import upgrade_head

    name = f"pagewise_faults_{secrets.token_hex(4)}"
    with psycopg.connect(admin_dsn, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    base = admin_dsn.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://")
    url = f"{base}/{name}"
    try:
        upgrade_head(url)
        yield url
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def jobs_worker(env: dict[str, str], log_path: Path):
    """`pagewise jobs worker` (billing exports) on the stack's database and Redis, stopped afterwards."""
    with log_path.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "pagewise.cli", "jobs", "worker", "--concurrency", "1", "--loglevel", "warning"],
            env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        yield process
    finally:
        stop_process_group(process)


def _price(base: str, admin_key: str, model: str) -> None:
    """A price for the model from now on, so the bills (and the exports) have costs to compare."""
    import httpx

    body = {"model": model, "input": 0.15, "output": 0.6}
    httpx.post(f"{base}/admin/prices", json=body, headers={"Authorization": f"Bearer {admin_key}"},
               timeout=30).raise_for_status()


def _exports_match(base: str, admin_key: str, direct_url: str, tenant_ids: list[str]) -> int:
    """After the run, each tenant's month exported by the jobs worker (which lived through the faults): how many
    exports arrive within a minute with the cost `usage_daily` holds for the tenant."""
    import datetime as dt

    import httpx
    from sqlalchemy import func, select

    from pagewise.jobs.database import session_factory
    from pagewise.platform.db.models import UsageDaily

    admin = {"Authorization": f"Bearer {admin_key}"}
    period = dt.datetime.now(dt.UTC).strftime("%Y-%m")
    with session_factory(direct_url)() as session:
        costs = dict(session.execute(
            select(UsageDaily.tenant_id, func.sum(UsageDaily.cost_micros))
            .where(UsageDaily.tenant_id.in_(tenant_ids)).group_by(UsageDaily.tenant_id)
        ).all())
    for tenant_id in tenant_ids:
        httpx.post(f"{base}/admin/exports", json={"tenant_id": tenant_id, "period": period}, headers=admin,
                   timeout=30).raise_for_status()
    matching: set[str] = set()
    deadline = time.monotonic() + 60
    while len(matching) < len(tenant_ids) and time.monotonic() < deadline:
        for tenant_id in set(tenant_ids) - matching:
            listed = httpx.get(f"{base}/admin/exports", params={"tenant_id": tenant_id, "period": period},
                               headers=admin, timeout=30).json()
            revisions = listed["data"] if isinstance(listed, dict) else listed
            if any(r["total_cost_micros"] == int(costs.get(tenant_id) or 0) for r in revisions):
                matching.add(tenant_id)
        time.sleep(1.0)
    return len(matching)


def _tenants(base: str, admin_key: str) -> tuple[list[str], list[str], str]:
    """The load's tenants (the last with a monthly token budget) and a probe tenant: their ids and keys."""
    import httpx

    admin = {"Authorization": f"Bearer {admin_key}"}
    unlimited = dict.fromkeys(("requests_per_minute", "tokens_per_minute", "max_concurrent_requests"))
    ids, keys = [], []
    for t in range(TENANTS + 1):
        budget = BUDGET_TOKENS if t == TENANTS - 1 else None
        body = {"name": f"faults-{t}-{secrets.token_hex(3)}", **unlimited, "monthly_token_budget": budget}
        tenant = httpx.post(f"{base}/admin/tenants", json=body, headers=admin, timeout=30).raise_for_status().json()
        key = httpx.post(f"{base}/admin/tenants/{tenant['id']}/keys", json={}, headers=admin, timeout=30)
        ids.append(tenant["id"])
        keys.append(key.raise_for_status().json()["key"])
    return ids[:TENANTS], keys[:TENANTS], keys[TENANTS]


async def _recovery(base: str, key: str, model: str, since: float, limit_s: float = 120.0) -> float:
    """Seconds from `since` until a probe request is answered 200 (one every 0.25 s)."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "probe"}], "max_tokens": 1}
    async with httpx.AsyncClient(timeout=30) as client:
        while time.monotonic() - since < limit_s:
            try:
                answer = await client.post(f"{base}/v1/chat/completions", json=body,
                                           headers={"Authorization": f"Bearer {key}"})
                if answer.status_code == 200:
                    return round(time.monotonic() - since, 2)
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.25)
    return float("inf")


async def _faults(stack: Stack, replica: LocalServer, load: Load, restart_redis, proxy: BackgroundProxy,
                  probe_key: str, engine_args: list[str], workdir: Path, gap_s: float) -> dict[str, float]:
    """Each fault in turn, `gap_s` of plain load before each; its recovery seconds."""
    base, model = stack.api.base, load.model
    recovery: dict[str, float] = {}

    async def fault(name: str, act) -> None:  # noqa: ANN001 - a blocking callable
        await asyncio.sleep(gap_s)
        log(f"fault: {name}")
        await asyncio.to_thread(act)
        recovery[name] = await _recovery(base, probe_key, model, time.monotonic())
        log(f"  served again after {recovery[name]} s")

    await fault("redis", restart_redis)

    def postgres_down() -> None:
        proxy.cut()
        time.sleep(POSTGRES_DOWN_S)
        proxy.restore()

    await fault("postgres", postgres_down)
    stalled, killed = stack.workers["w0"], stack.workers["w1"]

    def stall() -> None:
        stalled.send_signal(signal.SIGSTOP)
        time.sleep(STALL_S)
        stalled.send_signal(signal.SIGCONT)

    await fault("worker_stall", stall)

    def kill_worker() -> None:
        killed.kill()
        killed.wait()
        env = {**os.environ, **stack.api_env}
        env.pop("PAGEWISE_AUTO_MIGRATE", None)
        stack.workers["w2"] = start_worker("w2", engine_args, env, workdir / "worker-w2.log")

    await fault("worker_kill", kill_worker)

    def kill_api() -> None:
        load.dead_bases.add(replica.base)
        replica.process.kill()
        replica.process.wait()

    await fault("api_kill", kill_api)
    await asyncio.sleep(gap_s)
    return recovery


def _books(direct_url: str, tenant_ids: list[str], admitted: set[str]) -> dict[str, Any]:
    """Wait (bounded) until every admitted request has a final row, then compare rows, usage and the budget."""
    from sqlalchemy import func, select

    from pagewise.jobs.database import session_factory
    from pagewise.platform.db.models import RequestRecord, UsageDaily
    from pagewise.platform.requests.store import UNFINISHED_STATUSES

    sessions = session_factory(direct_url)
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        with sessions() as session:
            found = session.execute(
                select(RequestRecord.id, RequestRecord.status, RequestRecord.error).where(
                    RequestRecord.tenant_id.in_(tenant_ids)
                )
            ).all()
            rows = {i: status if not error else f"{status} ({error.split(':', 1)[0]})" for i, status, error in found}
        unfinished = {i for i in admitted if rows.get(i) in (None, *UNFINISHED_STATUSES)}
        if not unfinished or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    def tokens_by_tenant(table: type[RequestRecord] | type[UsageDaily]) -> dict[str, int]:
        total = func.sum(table.prompt_tokens + table.completion_tokens)
        query = select(table.tenant_id, total).where(table.tenant_id.in_(tenant_ids)).group_by(table.tenant_id)
        with sessions() as session:
            return dict(session.execute(query).all())

    billed_rows, usage = tokens_by_tenant(RequestRecord), tokens_by_tenant(UsageDaily)
    over = {t: int(usage.get(t) or 0) - int(billed_rows.get(t) or 0) for t in tenant_ids}
    statuses = Counter(rows.get(i, "missing") for i in admitted)
    return {
        "admitted": len(admitted),
        "ended": dict(statuses),
        "lost": len(unfinished),
        "double_billed_tokens": sum(max(0, v) for v in over.values()),
        "usage_minus_rows_tokens": over,
        "budget_tokens": BUDGET_TOKENS,
        "budgeted_tenant_tokens": int(usage.get(tenant_ids[-1]) or 0),
        "budget_exceeded": int(usage.get(tenant_ids[-1]) or 0) > BUDGET_TOKENS,
    }


def run(args: argparse.Namespace) -> int:
    engine_args = ["--model", args.model, "--max-model-len", str(args.max_model_len)]
    with ExitStack() as stack_of:
        if args.logs is not None:
            workdir = Path(args.logs)
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack_of.enter_context(tempfile.TemporaryDirectory(prefix="pagewise-faults-")))
        direct_url = stack_of.enter_context(fresh_postgres(args.postgres_admin_dsn))
        redis_url, restart_redis = stack_of.enter_context(private_redis(workdir))
        database = urlsplit(direct_url)
        proxy = BackgroundProxy(database.hostname or "127.0.0.1", database.port or 5432)
        stack_of.callback(proxy.close)
        proxied_url = direct_url.replace(f"@{database.netloc.split('@')[-1]}/", f"@127.0.0.1:{proxy.port}/")
        log("starting 2 workers and 2 API replicas …")
        exports = {"PAGEWISE_EXPORT_DIR": str(workdir / "exports")}
        stack = stack_of.enter_context(
            distributed_stack(workdir, proxied_url, engine_args, workers=2, redis_url=redis_url, env=exports)
        )
        stack_of.enter_context(jobs_worker({**stack.api_env}, workdir / "jobs.log"))
        second = workdir / "replica-2"
        second.mkdir()
        replica = stack_of.enter_context(local_server(second, proxied_url, ["--workers-external"], env=stack.api_env))
        tenant_ids, keys, probe_key = _tenants(stack.api.base, stack.api.admin_key)
        from pagewise.bench._common import served_model

        model = served_model(stack.api.base, keys[0], args.model)
        _price(stack.api.base, stack.api.admin_key, model)
        result = asyncio.run(_drive(stack, replica, keys, probe_key, model, restart_redis, proxy, engine_args,
                                    workdir, args.gap_s))
        admitted = {o.request_id for o in result["load"].outcomes if o.request_id}
        books = _books(direct_url, tenant_ids, admitted)
        books["exports_matching_usage"] = _exports_match(stack.api.base, stack.api.admin_key, direct_url, tenant_ids)
    outcomes = result["load"].outcomes
    statuses = Counter(str(o.status) for o in outcomes)
    refusals = Counter(f"{o.kind} {o.status} {o.code}" for o in outcomes if o.status not in (200, 202))
    figures = {
        "requests_sent": len(outcomes),
        "answers": dict(statuses),
        "refusals": dict(refusals),
        "server_errors_other_than_503": sum(n for s, n in statuses.items() if s.isdigit() and int(s) >= 500
                                            and s != "503"),
        "faults": len(result["recovery"]),
        "recovery_s": result["recovery"],
        **books,
    }
    ok = figures["lost"] == 0 and figures["double_billed_tokens"] == 0 and not figures["budget_exceeded"] and \
        figures["server_errors_other_than_503"] == 0 and figures["exports_matching_usage"] == TENANTS
    figures["ok"] = ok
    if args.json:
        print(json.dumps(figures))
    else:
        for name, value in figures.items():
            print(f"{name:<30} {value}")
    return ExitStatus.OK if ok else ExitStatus.FAILED


async def _drive(stack: Stack, replica: LocalServer, keys: list[str], probe_key: str, model: str, restart_redis,
                 proxy: BackgroundProxy, engine_args: list[str], workdir: Path, gap_s: float) -> dict[str, Any]:  # noqa: ANN001
    load = Load([stack.api.base, replica.base], keys, model)
    running = asyncio.create_task(load.run())
    try:
        recovery = await _faults(stack, replica, load, restart_redis, proxy, probe_key, engine_args, workdir, gap_s)
    finally:
        load.stop.set()
        await running
    return {"load": load, "recovery": recovery}


def register(subparsers) -> None:
    parser = subparsers.add_parser("faults", help="the distributed stack under load while Redis, PostgreSQL, "
                                   "workers and an API replica fail; every request ends once, billed once")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--postgres-admin-dsn", default=os.environ.get(
        "PAGEWISE_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"),
        help="a PostgreSQL superuser DSN: the bench creates (and drops) a database of its own there")
    parser.add_argument("--gap-s", type=float, default=8.0, help="seconds of plain load before each fault")
    parser.add_argument("--logs", help="keep every process's log in this folder (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.set_defaults(func=run)
