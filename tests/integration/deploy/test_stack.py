"""The compose stack without Docker: every pagewise service of `docker-compose.yml` runs its own command and its
own environment as a local process, against this machine's PostgreSQL and Redis (the compose hostnames mapped to
127.0.0.1, a fresh database and key prefix). `migrate` runs first and must succeed; then the long-running services
start (the `cpu` worker profile, the jobs worker and beat), each passes its own healthcheck, a request goes
through the API to the worker, and a billing export through the jobs worker. A wrong command, variable or port in
the compose file fails here.
"""

from __future__ import annotations

import datetime as dt
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .stack_files import compose_stack, pagewise_services

REDIS_HOST = os.environ.get("PAGEWISE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0").split("://", 1)[1].split("/")[0]
START_TIMEOUT_S = 300


def _local_environment(environment: dict[str, str], database_url: str, prefix: str, root: Path) -> dict[str, str]:
    """The service's variables with compose's hostnames mapped to this machine and its volumes to local folders
    (the model cache to this user's, the exports volume under `root`). No collector runs here, so the OTLP
    endpoint is dropped: tracing is tested on its own (`tests/integration/tracing`)."""
    cache = os.environ.get("PAGEWISE_CACHE_DIR", str(Path.home() / ".cache" / "pagewise"))
    local = {
        key: value.replace("redis:6379", REDIS_HOST)
        .replace("/var/cache/pagewise", cache)
        .replace("/var/lib/pagewise", str(root))
        for key, value in environment.items()
        if not key.startswith("OTEL_")
    }
    local["PAGEWISE_DATABASE_URL"] = database_url
    local["PAGEWISE_REDIS_KEY_PREFIX"] = prefix
    return local


def _argv(command: list[str]) -> list[str]:
    assert command[0] == "pagewise"
    return [sys.executable, "-m", "pagewise.cli", *command[1:]]


def _healthcheck(service: dict[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "python"
    return [sys.executable, *test[2:]]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture
def services(tmp_path: Path, fresh_database: Callable[[str], str]) -> Iterator[dict[str, Any]]:
    stack = pagewise_services(compose_stack())
    database_url = fresh_database("postgres")
    prefix = f"pagewise_stack_{secrets.token_hex(4)}:"
    env = {name: {**os.environ, **_local_environment(s.get("environment", {}), database_url, prefix, tmp_path)}
           for name, s in stack.items()}
    migrate = subprocess.run(_argv(stack["migrate"]["command"]), env=env["migrate"], capture_output=True, text=True,
                             timeout=120)
    assert migrate.returncode == 0, migrate.stderr
    running = {name: s for name, s in stack.items() if name != "migrate" and set(s.get("profiles", ["cpu"])) & {"cpu"}}
    for port in (8000, 9100):
        assert _port_free(port), f"port {port} (the compose services' own) is taken on this machine"
    processes = {}
    for name, service in running.items():
        log = (tmp_path / f"{name}.log").open("w")
        processes[name] = subprocess.Popen(_argv(service["command"]), env=env[name], stdout=log,
                                           stderr=subprocess.STDOUT)
    try:
        yield {"stack": running, "processes": processes, "env": env, "logs": tmp_path}
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def test_the_compose_services_run_and_serve_a_request(services: dict[str, Any]) -> None:
    stack, processes, logs = services["stack"], services["processes"], services["logs"]
    assert {"api", "worker-cpu"} <= set(stack)
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = {name for name, service in stack.items() if "healthcheck" in service}
    while pending:
        for name in sorted(pending):
            assert processes[name].poll() is None, f"{name} exited:\n{(logs / f'{name}.log').read_text()}"
            check = subprocess.run(_healthcheck(stack[name]), capture_output=True, timeout=30)
            if check.returncode == 0:
                pending.discard(name)
        assert time.monotonic() < deadline, f"not healthy in time: {pending}"
        time.sleep(0.5)
    admin = {"Authorization": f"Bearer {services['env']['api']['PAGEWISE_ADMIN_KEY']}"}
    with httpx.Client(base_url="http://127.0.0.1:8000", timeout=120) as http:
        while http.get("/ready").status_code != 200:  # the worker announces itself
            assert time.monotonic() < deadline, "the API never saw the worker"
            time.sleep(0.5)
        tenant = http.post("/admin/tenants", json={"name": f"stack-{secrets.token_hex(3)}"}, headers=admin).json()
        key = http.post(f"/admin/tenants/{tenant['id']}/keys", json={}, headers=admin).json()["key"]
        body = {"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        response = http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        workers = http.get("/admin/workers", headers=admin).json()["data"]
        assert len(workers) == 1 and workers[0]["model"] == "smollm2-135m-instruct"
        token = services["env"]["api"]["PAGEWISE_METRICS_TOKEN"]
        assert http.get("/metrics", headers={"Authorization": f"Bearer {token}"}).status_code == 200

        # a billing export of this month, run by the jobs worker, listed and downloaded through the API
        period = dt.datetime.now(dt.UTC).strftime("%Y-%m")
        queued = http.post("/admin/exports", json={"tenant_id": tenant["id"], "period": period}, headers=admin)
        assert queued.status_code == 202, queued.text
        while not (exports := http.get("/admin/exports", params={"tenant_id": tenant["id"]}, headers=admin).json()):
            assert processes["jobs-worker"].poll() is None, (logs / "jobs-worker.log").read_text()
            assert time.monotonic() < deadline, "the jobs worker never wrote the export"
            time.sleep(0.5)
        [export] = exports
        assert export["period"] == period and export["num_rows"] >= 1
        csv = http.get(f"/admin/exports/{export['id']}/csv", headers=admin)
        assert csv.status_code == 200 and tenant["id"] in csv.text
