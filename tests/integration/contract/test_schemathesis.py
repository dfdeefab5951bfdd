"""API fuzzing from the OpenAPI document: a real server on each backend, schemathesis generating the cases.

Each run must generate at least `MIN_CASES` cases and find no failure of the checks below: no 5xx on any input,
every status and body as documented (errors in OpenAI's shape), content types as declared. It runs twice per
backend: with a tenant's inference key (admin operations must then answer 403, never fail), then with the
bootstrap admin key (both scopes: every operation). The admin tenant's `max_tokens_per_request` is lowered so that the
valid inference cases the fuzzer finds stay cheap on a CPU.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from pagewise.platform.keys.key_format import generate_key

from ..conftest import REDIS_URL, TEST_MAX_MODEL_LEN

MIN_CASES = 1000
CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,"
    "response_schema_conformance,response_headers_conformance"
)
MAX_EXAMPLES = 12
SEED = os.environ.get("PAGEWISE_FUZZ_SEED", "20261201")
_CASES = re.compile(r"(\d+) generated")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module", params=["sqlite", "postgres+redis"])
def server(
    request: pytest.FixtureRequest, fresh_database: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """(base URL, admin key) of `pagewise serve` on a fresh database of the backend."""
    backend = request.param
    admin_key = generate_key().key
    port = _free_port()
    env = {
        **os.environ,
        "PAGEWISE_DATABASE_URL": fresh_database("sqlite" if backend == "sqlite" else "postgres"),
        "PAGEWISE_ADMIN_KEY": admin_key,
    }
    env.pop("PAGEWISE_REDIS_URL", None)
    if backend == "postgres+redis":
        env["PAGEWISE_REDIS_URL"] = REDIS_URL
        env["PAGEWISE_REDIS_KEY_PREFIX"] = f"pagewise_fuzz_{secrets.token_hex(4)}:"
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    command = [
        str(Path(sys.executable).parent / "pagewise"), "serve", "--port", str(port),
        "--max-model-len", str(TEST_MAX_MODEL_LEN),
    ]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, process, log)
        yield base, admin_key
    finally:
        process.terminate()
        process.wait(timeout=60)


def _wait_ready(base: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready in time:\n{log.read_text()}")


def _cheapen_admin_tenant(base: str, admin_key: str) -> None:
    """The bootstrap tenant's valid inference cases generate at most 4 tokens."""
    admin = {"Authorization": f"Bearer {admin_key}"}
    [bootstrap] = httpx.get(f"{base}/admin/tenants", headers=admin).json()
    patched = httpx.patch(
        f"{base}/admin/tenants/{bootstrap['id']}", json={"max_tokens_per_request": 4}, headers=admin
    )
    assert patched.status_code == 200, patched.text


def _tenant_key(base: str, admin_key: str) -> str:
    """A fresh tenant's inference key. Its run goes first: the admin run may revoke or suspend what it finds."""
    admin = {"Authorization": f"Bearer {admin_key}"}
    tenant = httpx.post(
        f"{base}/admin/tenants", json={"name": f"fuzz-{secrets.token_hex(4)}", "max_tokens_per_request": 4},
        headers=admin,
    ).json()
    key = httpx.post(f"{base}/admin/tenants/{tenant['id']}/keys", json={}, headers=admin)
    assert key.status_code == 201, key.text
    return key.json()["key"]


def _fuzz(base: str, key: str, workdir: Path) -> tuple[int, str]:
    """Run schemathesis against the server's document; (cases generated, its output)."""
    command = [
        str(Path(sys.executable).parent / "schemathesis"), "run", f"{base}/schema/openapi.json",
        "--header", f"Authorization: Bearer {key}", "--checks", CHECKS, "--max-examples", str(MAX_EXAMPLES),
        "--seed", SEED, "--continue-on-failure", "--suppress-health-check", "all", "--no-color",
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=workdir, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-8000:]
    match = _CASES.search(output)
    assert match, output[-4000:]
    return int(match.group(1)), output


@pytest.mark.timeout(1800)
def test_fuzzed_api_has_no_server_errors_and_matches_its_schema(
    server: tuple[str, str], tmp_path: Path
) -> None:
    base, admin_key = server
    _cheapen_admin_tenant(base, admin_key)
    for role in ("tenant", "admin"):
        key = admin_key if role == "admin" else _tenant_key(base, admin_key)
        cases, output = _fuzz(base, key, tmp_path)
        assert cases >= MIN_CASES, output[-4000:]
        print(f"schemathesis ({role} key): {cases} cases, no failures ({base})")
