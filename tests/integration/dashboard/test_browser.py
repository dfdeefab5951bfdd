"""The dashboard in a real browser (headless Chromium) against a real `pagewise serve`: an admin's whole journey.

Sign in, create a tenant and a key, call `/v1/completions` with that key, find the request in the list and in the
usage chart, revoke the key and watch the next call fail with 401; an inference key cannot sign in; a form posted
without its CSRF token is refused with 403 and changes nothing. Every page is saved as a screenshot, and no page
may send a request to any host but the server's own.
"""

from __future__ import annotations

import csv
import re
import secrets
from pathlib import Path

import httpx
from playwright.sync_api import Browser, Page, expect

from pagewise.bench.local_server import LocalServer
from pagewise.platform.dashboard.controllers.login import NOT_ADMIN

from .conftest import UI

MODEL = "smollm2-135m-instruct"


def _snap(page: Page, artefacts: Path, name: str) -> None:
    page.screenshot(path=artefacts / f"{name}.png", full_page=True)


def _sign_in(page: Page, key: str) -> None:
    page.goto(f"{UI}/")
    expect(page).to_have_url(re.compile(f"{UI}/login$"))  # not signed in yet: sent to the login page
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()


def _complete(server: LocalServer, key: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Say hi", "max_tokens": 3, "temperature": 0}
    return httpx.post(f"{server.base}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})


def test_admin_journey_in_a_browser(server: LocalServer, chromium: Browser, artefacts: Path) -> None:
    context = chromium.new_context(base_url=server.base, viewport={"width": 1360, "height": 860})
    requested: list[str] = []
    context.on("request", lambda request: requested.append(request.url))
    page = context.new_page()

    page.goto(f"{UI}/login")
    _snap(page, artefacts, "login")
    _sign_in(page, server.admin_key)
    expect(page.get_by_role("heading", name="Overview")).to_be_visible()

    name = f"acme-{secrets.token_hex(3)}"  # a tenant, then a key for it: the key is shown once
    page.get_by_role("link", name="Tenants").click()
    page.get_by_label("Name").fill(name)
    page.get_by_label("Weight").fill("2")
    page.get_by_role("button", name="Create tenant").click()
    expect(page.get_by_role("status")).to_have_text(f"Created tenant {name}.")
    tenant_url = page.url
    tenant_id = tenant_url.rsplit("/", 1)[1]
    page.locator("form[action$='/keys']").get_by_label("Name").fill("browser")
    page.get_by_role("button", name="Create key").click()
    key = page.locator("#new-key").input_value()
    assert key.startswith("pw_")
    _snap(page, artefacts, "key-created")

    completion = _complete(server, key)
    assert completion.status_code == 200, completion.text
    request_id = completion.json()["id"]

    page.get_by_role("link", name="Requests").click()
    page.get_by_label("Tenant").select_option(label=name)
    page.get_by_role("button", name="Search").click()
    row = page.locator(f"tr[data-request-id='{request_id}']")
    expect(row).to_contain_text("completed")
    _snap(page, artefacts, "requests")
    row.get_by_role("link").click()
    expect(page.get_by_role("heading", name="Usage")).to_be_visible()
    expect(page.locator("dl").last).to_contain_text("of which cached")
    _snap(page, artefacts, "request-detail")

    page.get_by_role("link", name="Usage", exact=True).click()
    bar = page.locator("figure.chart rect", has_text=name)  # a stacked segment's tooltip names its tenant
    expect(bar).to_have_count(1)
    usage = completion.json()["usage"]
    expect(bar).to_contain_text(f"{usage['prompt_tokens'] + usage['completion_tokens']:,} tokens")
    with page.expect_download() as download:
        page.get_by_role("link", name="Download CSV").click()
    rows = list(
        csv.DictReader(Path(download.value.path()).read_text().splitlines())
    )  # the page's data: grouped by tenant
    assert [(r["tenant_id"], r["num_model_requests"]) for r in rows if r["tenant_id"] == tenant_id] == [
        (tenant_id, "1")
    ]
    _snap(page, artefacts, "usage")

    page.get_by_role("link", name="Workers").click()
    expect(page.locator("tbody tr")).to_contain_text(MODEL)
    _snap(page, artefacts, "workers")

    page.get_by_role("link", name="Keys").click()
    _snap(page, artefacts, "keys")
    page.locator("tr", has_text="browser").get_by_role("button", name="Revoke").click()
    expect(page.get_by_role("status")).to_contain_text("Revoked key")
    refused = _complete(server, key)
    assert refused.status_code == 401 and refused.json()["error"]["message"] == "This API key has been revoked"

    page.goto(tenant_url)  # a form whose CSRF token was removed is refused and changes nothing
    _snap(page, artefacts, "tenant")
    edit = page.locator("form", has=page.get_by_role("button", name="Save"))
    edit.locator("input[name=csrf_token]").evaluate("input => input.remove()")
    edit.get_by_label("Weight").fill("9")
    with page.expect_response(lambda r: r.request.method == "POST") as answer:
        edit.get_by_role("button", name="Save").click()
    assert answer.value.status == 403
    expect(page.locator(".error-message")).to_contain_text("CSRF token")
    admin = {"Authorization": f"Bearer {server.admin_key}"}
    assert httpx.get(f"{server.base}/admin/tenants/{tenant_id}", headers=admin).json()["weight"] == 2.0

    page.get_by_role("link", name="Back to the dashboard").click()
    _snap(page, artefacts, "overview")
    page.get_by_role("button", name="Log out").click()
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()

    inference_key = httpx.post(f"{server.base}/admin/tenants/{tenant_id}/keys", json={}, headers=admin).json()["key"]
    _sign_in(page, inference_key)  # a tenant's inference key is refused at login
    expect(page.get_by_role("alert")).to_have_text(NOT_ADMIN)
    _snap(page, artefacts, "login-refused")

    page.goto("/schema")  # the API docs work offline: Swagger UI from this server
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("pagewise")
    _snap(page, artefacts, "schema")

    context.close()
    foreign = [url for url in requested if not url.startswith(f"{server.base}/")]
    assert not foreign, foreign
