"""The distributed stack on this machine: `pagewise worker` processes plus one `pagewise serve --workers-external`.

What benchmarks and process-level tests drive. Every process gets the same database, Redis and key prefix (a
fresh prefix per stack, so stacks never see each other's streams); their output goes to log files in `workdir`.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pagewise.bench.local_server import LocalServer, local_server

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
WORKERS_UP_TIMEOUT_S = 300


@dataclass(frozen=True, slots=True)
class Stack:
    api: LocalServer
    workers: dict[str, subprocess.Popen]
    redis_url: str
    key_prefix: str
    api_env: dict[str, str]  # what another API replica of this stack needs (`local_server(..., env=api_env)`)


def start_worker(worker_id: str, args: Sequence[str], env: Mapping[str, str], log: Path) -> subprocess.Popen:
    """`pagewise worker --worker-id <id> <args>` with `env`, its output in `log`."""
    argv = [sys.executable, "-m", "pagewise.cli", "worker", "--worker-id", worker_id, *args]
    with log.open("w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(env))


@contextmanager
def distributed_stack(
    workdir: Path,
    database_url: str,
    engine_args: Sequence[str],
    *,
    workers: int = 2,
    redis_url: str | None = None,
    env: Mapping[str, str] | None = None,
    serve_args: Sequence[str] = (),
) -> Iterator[Stack]:
    """Start `workers` workers (`engine_args`: `--model`, `--max-model-len`, …) and an API replica serving that
    model, on an already migrated `database_url`; yield once the API sees every worker; stop all afterwards."""
    import httpx

    redis_url = redis_url or os.environ.get("PAGEWISE_REDIS_URL", DEFAULT_REDIS_URL)
    prefix = f"pagewise_stack_{secrets.token_hex(4)}:"
    model = _flag(engine_args, "--model")
    common = {
        "PAGEWISE_DATABASE_URL": database_url,
        "PAGEWISE_REDIS_URL": redis_url,
        "PAGEWISE_REDIS_KEY_PREFIX": prefix,
        **(env or {}),
    }
    processes = {
        f"w{i}": start_worker(f"w{i}", engine_args, {**os.environ, **common}, workdir / f"worker-w{i}.log")
        for i in range(workers)
    }
    api_env = {**common, "PAGEWISE_AUTO_MIGRATE": "false", **({"PAGEWISE_MODEL": model} if model else {})}
    try:
        with local_server(workdir, database_url, ["--workers-external", *serve_args], env=api_env) as api:
            _wait_for_workers(httpx, api, workers, processes, workdir)
            yield Stack(api, processes, redis_url, prefix, api_env)
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _flag(args: Sequence[str], name: str) -> str | None:
    args = list(args)
    return args[args.index(name) + 1] if name in args else None


def _wait_for_workers(httpx, api: LocalServer, expected: int, processes: dict, workdir: Path) -> None:  # noqa: ANN001
    deadline = time.monotonic() + WORKERS_UP_TIMEOUT_S
    headers = {"Authorization": f"Bearer {api.admin_key}"}
    while True:
        listed = httpx.get(f"{api.base}/admin/workers", headers=headers, timeout=10).json()["data"]
        if len(listed) >= expected:
            return
        for worker_id, process in processes.items():
            if process.poll() is not None:
                log = (workdir / f"worker-{worker_id}.log").read_text()
                raise RuntimeError(f"worker {worker_id} exited with {process.returncode}:\n{log}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(listed)} of {expected} workers came up in {WORKERS_UP_TIMEOUT_S} s")
        time.sleep(0.25)
