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
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from pagewise.bench.local_server import local_server

from ..conftest import REDIS_URL, TEST_MAX_MODEL_LEN

MIN_CASES = 1000
CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,"
    "response_schema_conformance,response_headers_conformance"
)
MAX_EXAMPLES = 12
SEED = os.environ.get("PAGEWISE_FUZZ_SEED", "20261201")
_CASES = re.compile(r"(\d+) generated")


@pytest.fixture(scope="module", params=["sqlite", "postgres+redis"])
def server(
    request: pytest.FixtureRequest, fresh_database: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """(base URL, admin key) of `pagewise serve` on a fresh database of the backend."""
    backend = request.param
    env = {}
    if backend == "postgres+redis":
        env = {"PAGEWISE_REDIS_URL": REDIS_URL, "PAGEWISE_REDIS_KEY_PREFIX": f"pagewise_fuzz_{secrets.token_hex(4)}:"}
    database_url = fresh_database("sqlite" if backend == "sqlite" else "postgres")
    args = ["--max-model-len", str(TEST_MAX_MODEL_LEN)]
    with local_server(tmp_path_factory.mktemp("fuzz"), database_url, args, env=env) as server:
        yield server.base, server.admin_key


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
