"""One request can no longer stop the engine for every tenant; a dead engine is visible and ends the process.

- A request that raises inside the engine's step fails alone (its row `failed`, its quota settled) while another
  tenant's concurrent request is served and `/ready` stays 200.
- An engine whose loop died answers `/ready` 503 and every inference request 503 `engine_unavailable`.
- `pagewise serve` whose engine dies shuts down by itself with exit status 3, so a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from pagewise.bench.local_server import local_server
from pagewise.engine.async_engine import AsyncLLMEngine
from pagewise.engine.request_group import SampleState
from pagewise.platform.app import create_app
from pagewise.platform.keys.key_format import generate_key
from pagewise.platform.quotas.memory_store import InProcessQuotaStore
from pagewise.platform.settings import Settings

from ..conftest import TEST_MAX_MODEL_LEN, TEST_MODEL
from ..harness import MODEL, Platform, bearer

pytestmark = pytest.mark.anyio
POISON = 4242  # a prompt starting with this token id makes the engine raise while processing its tokens


async def test_a_request_raising_in_the_step_fails_alone(platform: Platform, monkeypatch: pytest.MonkeyPatch) -> None:
    original = SampleState.after_token

    def poisoned(self: SampleState, *args: object) -> object:
        if self.request.prompt_token_ids[0] == POISON:
            raise RuntimeError("poisoned request")
        return original(self, *args)

    monkeypatch.setattr(SampleState, "after_token", poisoned)
    victim_tenant, victim = await platform.tenant_with_key()
    _, bystander = await platform.tenant_with_key()
    bad = {"model": MODEL, "prompt": [POISON, 11, 12, 13], "max_tokens": 8}
    good = {"model": MODEL, "prompt": "Tell me about paged attention.", "max_tokens": 12, "ignore_eos": True}
    failed, served = await asyncio.gather(
        platform.http.post("/v1/completions", json=bad, headers=bearer(victim)),
        platform.http.post("/v1/completions", json=good, headers=bearer(bystander)),
    )
    assert failed.status_code == 500 and set(failed.json()["error"]) == {"message", "type", "param", "code"}
    assert "poisoned" not in failed.text  # internal errors stay internal
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 12
    assert (await platform.http.get("/ready")).status_code == 200
    [row] = (await platform.http.get("/v1/requests", headers=bearer(victim))).json()["data"]
    assert row["status"] == "failed" and row["error"] == {
        "code": "internal_error",
        "message": "the engine failed while running this request",
    }
    assert "poisoned" not in str(row)  # the stored error is public too: the cause is in the log only
    quota = await platform.services.quotas.usage(victim_tenant["id"])
    assert quota.concurrent == 0 and quota.tokens_this_minute == row["usage"]["total_tokens"]
    again = await platform.http.post("/v1/completions", json=good, headers=bearer(victim))
    assert again.status_code == 200, again.text


@pytest.fixture
async def dying_platform(database_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, str, AsyncLLMEngine]]:
    """An app over an engine of its own (a dead engine stays dead), with the forward pass always failing."""
    from pagewise.engine.config import EngineConfig

    engine = AsyncLLMEngine(
        EngineConfig(
            model=TEST_MODEL, max_model_len=TEST_MAX_MODEL_LEN, kv_cache_memory_bytes=64 * 2**20, dtype="float32"
        ),
        progress=False,
    )

    def broken(*_: object) -> None:
        raise RuntimeError("the device fell off the bus")

    engine.engine.runner.start = broken
    admin_key = generate_key().key
    settings = Settings.from_env({}, database_url=database_url, auto_migrate=False, admin_key=admin_key)
    app = create_app(settings, engine=engine, quotas=InProcessQuotaStore())
    async with app.lifespan():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            from pagewise.platform.keys.schemas import KeyCreate
            from pagewise.platform.keys.service import KeyService
            from pagewise.platform.tenants.schemas import TenantCreate
            from pagewise.platform.tenants.service import TenantService

            async with app.state.sessionmaker() as session:
                tenant = await TenantService(session).create(TenantCreate(name=f"dying-{generate_key().prefix}"))
                key = (await KeyService(session).create(tenant.id, KeyCreate())).key
            yield http, key, engine
    engine.shutdown()


async def test_a_dead_engine_is_not_ready_and_refuses_requests(
    dying_platform: tuple[httpx.AsyncClient, str, AsyncLLMEngine],
) -> None:
    http, key, engine = dying_platform
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    statuses = [(await http.post("/v1/completions", json=body, headers=bearer(key))).status_code for _ in range(3)]
    assert all(s in (500, 503) for s in statuses), statuses  # each failed step fails its request; the third kills
    assert engine.error is not None
    ready = await http.get("/ready")
    assert ready.status_code == 503 and ready.json()["model_loaded"] is False
    refused = await http.post("/v1/completions", json=body, headers=bearer(key))
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"


def test_serve_exits_with_status_3_when_its_engine_dies(tmp_path: Path) -> None:
    """The real server, with the forward pass broken by the test before it starts (the engine in a thread of the
    server, where the test's patch reaches it)."""
    script = tmp_path / "serve_broken.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            from pagewise.engine.model_runner import ModelRunner
            from pagewise.cli import main

            def broken(self, step):
                raise RuntimeError("injected by the test")

            ModelRunner.start = broken
            sys.exit(main(["serve", *sys.argv[1:]]))
            """
        )
    )
    args = ["--max-model-len", str(TEST_MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(64 * 2**20)]
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'dying.db'}"
    thread = {"PAGEWISE_ENGINE_PROCESS": "false"}
    with local_server(tmp_path, database_url, args, env=thread, command=[sys.executable, str(script)]) as server:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
        for _ in range(3):  # three failed steps in a row kill the engine
            if server.process.poll() is not None:
                break
            try:
                httpx.post(f"{server.base}/v1/completions", json=body, headers=bearer(server.admin_key), timeout=30)
            except httpx.HTTPError:
                break
        assert server.process.wait(timeout=60) == 3, server.log_path.read_text()[-3000:]
        assert "the engine stopped after an error" in server.log_path.read_text()


def _engine_process_of(server_pid: int) -> int:
    """The pid of the server's engine-core child (spawned by multiprocessing; its resource tracker is not it)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if parent == server_pid and b"spawn_main" in cmdline:
            return int(entry.name)
    raise AssertionError(f"no engine process under the server {server_pid}")


def test_serve_exits_with_status_3_when_its_engine_process_is_killed(tmp_path: Path) -> None:
    """The real server with its engine in a child process (the default): SIGKILL that child and the server
    fails what was running, then stops with status 3 for its supervisor."""
    args = ["--max-model-len", str(TEST_MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(64 * 2**20)]
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'killed.db'}"
    with local_server(tmp_path, database_url, args) as server:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
        ok = httpx.post(f"{server.base}/v1/completions", json=body, headers=bearer(server.admin_key), timeout=60)
        assert ok.status_code == 200, ok.text
        os.kill(_engine_process_of(server.process.pid), signal.SIGKILL)
        assert server.process.wait(timeout=60) == 3, server.log_path.read_text()[-3000:]
        log = server.log_path.read_text()
        assert "the engine process exited" in log and "the engine stopped after an error" in log


async def test_a_request_no_engine_took_keeps_its_cause_out_of_its_row(
    platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hand-over failed (Redis down): the row is failed with our code and a public message; the driver's
    text, with its addresses, goes to the log only."""

    async def refused(submit: object) -> None:
        raise ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(platform.services.engine.transport, "submit", refused)
    _, key = await platform.tenant_with_key()
    body = {"endpoint": "/v1/chat/completions", "model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    created = await platform.http.post("/v1/requests", json=body, headers=bearer(key))
    assert created.status_code == 503 and created.headers["Retry-After"] == "5" and "6379" not in created.text
    assert created.json()["error"]["code"] == "engine_unavailable"
    [row] = (await platform.http.get("/v1/requests", headers=bearer(key))).json()["data"]
    assert row["status"] == "failed"
    assert row["error"] == {"code": "engine_unavailable", "message": "the request could not be handed to an engine"}
    assert "6379" not in str(row)


async def test_a_submit_taken_after_its_rows_lease_is_not_run(
    platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Submit whose row's lease ran out before an engine took it (it sat in a dead worker's inbox) is refused
    with `queue_timeout`: computing it would bill nobody and deliver to nobody."""
    from pagewise.platform.services import PlatformServices

    expired = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    monkeypatch.setattr(PlatformServices, "lease_expiry", lambda self: expired)
    _, key = await platform.tenant_with_key()
    before = platform.services.engine.transport.stats()["prompt_tokens_total"]
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
    refused = await platform.http.post("/v1/completions", json=body, headers=bearer(key))
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_timeout", refused.text
    [row] = (await platform.http.get("/v1/requests", headers=bearer(key))).json()["data"]
    assert row["status"] == "failed" and row["usage"]["completion_tokens"] == 0
    assert platform.services.engine.transport.stats()["prompt_tokens_total"] == before  # never reached the engine
