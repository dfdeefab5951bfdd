"""Fixtures for the dashboard: a signed-in HTTP client over ASGI, and for the browser tests a real
`pagewise serve` process with headless Chromium (Debian's, driven by Playwright).

Screenshots go to `test-artifacts/dashboard/` at the repository root (git-ignored), one per page.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, sync_playwright

from pagewise.bench.local_server import LocalServer, local_server

from ..harness import Platform

CHROMIUM = Path("/usr/bin/chromium")
ARTEFACTS = Path(__file__).resolve().parents[3] / "test-artifacts" / "dashboard"
UI = "/admin/ui"
_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


def csrf_token(html: str) -> str:
    """The CSRF token of the first form on a page."""
    match = _CSRF.search(html)
    assert match, html[:2000]
    return match.group(1)


async def sign_in(http: httpx.AsyncClient, key: str) -> httpx.Response:
    """Post the login form with `key` (and the form's own CSRF token); the client keeps the cookies."""
    form = await http.get(f"{UI}/login")
    return await http.post(f"{UI}/login", data={"csrf_token": csrf_token(form.text), "api_key": key})


@pytest.fixture
async def admin_browser(platform: Platform) -> AsyncIterator[httpx.AsyncClient]:
    """A cookie-keeping client of the `platform` app, signed in to the dashboard with the platform's admin key."""
    transport = httpx.ASGITransport(app=platform.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
        signed_in = await sign_in(http, platform.admin_key)
        assert signed_in.status_code == 303 and signed_in.headers["location"] == f"{UI}/", signed_in.text
        yield http


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    """`pagewise serve` with the default model on a fresh SQLite database; its admin key is PAGEWISE_ADMIN_KEY."""
    workdir = tmp_path_factory.mktemp("dashboard")
    with local_server(workdir, f"sqlite+aiosqlite:///{workdir / 'dashboard.db'}", ["--max-model-len", "512"]) as s:
        yield s


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    """Headless Debian Chromium (`make install` installs it; Playwright never downloads a browser here)."""
    if not CHROMIUM.exists():
        pytest.fail(f"no browser at {CHROMIUM}: `make install` installs Debian's chromium package")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def artefacts() -> Path:
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    return ARTEFACTS
